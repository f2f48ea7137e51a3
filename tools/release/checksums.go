package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// checksumsFile lists the SHA-256 of every other file of the release, in
// sha256sum's format: `sha256sum -c checksums.txt` checks them.
const checksumsFile = "checksums.txt"

func writeChecksums(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var lines []string
	for _, e := range entries {
		if e.IsDir() || e.Name() == checksumsFile {
			continue
		}
		sum, err := sha256File(filepath.Join(dir, e.Name()))
		if err != nil {
			return err
		}
		lines = append(lines, sum+"  "+e.Name()+"\n")
	}
	sort.Strings(lines)
	return os.WriteFile(filepath.Join(dir, checksumsFile), []byte(strings.Join(lines, "")), 0o644)
}

func sha256File(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("checksum of %s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// list prints the release's files with their sizes.
func (r *release) list(w io.Writer) error {
	entries, err := os.ReadDir(r.out)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "release %s (commit %s, built %s) in %s:\n", r.version, r.commit, r.built, r.out)
	for _, e := range entries {
		info, err := e.Info()
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "  %12d  %s\n", info.Size(), e.Name())
	}
	return nil
}
