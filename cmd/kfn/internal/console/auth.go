package console

import (
	"bufio"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"io"
	"strings"
)

// Roles a console user may have.
const (
	RoleViewer = "viewer" // reads every page
	RoleWriter = "writer" // also retries, discards and replays (with --allow-writes)
)

// User is one account of an auth file.
type User struct {
	Name string
	Role string
	hash [sha256.Size]byte // SHA-256 of the user's secret
}

// ParseAuthFile reads an auth file: one user a line,
//
//	name:role:sha256:HEX
//
// where role is viewer or writer and HEX is the SHA-256 of the user's
// secret in hex (printf %s "$SECRET" | sha256sum). Blank lines and lines
// starting with # are skipped. A bad line is an error naming its number;
// so are a repeated name and a file with no user.
func ParseAuthFile(r io.Reader) ([]User, error) {
	var users []User
	seen := map[string]bool{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		parts := strings.Split(line, ":")
		if len(parts) != 4 {
			return nil, fmt.Errorf("line %d: want name:role:sha256:HEX, got %d fields", n, len(parts))
		}
		name, role, scheme, digest := parts[0], parts[1], parts[2], strings.ToLower(parts[3])
		switch {
		case name == "" || strings.ContainsAny(name, " \t"):
			return nil, fmt.Errorf("line %d: the user name is empty or holds a space", n)
		case role != RoleViewer && role != RoleWriter:
			return nil, fmt.Errorf("line %d: role %q: use %s or %s", n, role, RoleViewer, RoleWriter)
		case scheme != "sha256":
			return nil, fmt.Errorf("line %d: scheme %q: only sha256 is known (the hex SHA-256 of the secret)", n, scheme)
		case seen[name]:
			return nil, fmt.Errorf("line %d: user %q is listed twice", n, name)
		}
		raw, err := hex.DecodeString(digest)
		if err != nil || len(raw) != sha256.Size {
			return nil, fmt.Errorf("line %d: the SHA-256 must be 64 hex digits", n)
		}
		u := User{Name: name, Role: role}
		copy(u.hash[:], raw)
		users = append(users, u)
		seen[name] = true
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(users) == 0 {
		return nil, fmt.Errorf("it lists no user")
	}
	return users, nil
}

// authenticate returns the user whose name and secret match; it compares
// every user's hash in constant time, so a wrong name and a wrong secret
// take the same time.
func authenticate(users []User, name, secret string) (User, bool) {
	sum := sha256.Sum256([]byte(secret))
	var found User
	ok := 0
	for _, u := range users {
		nameOK := subtle.ConstantTimeCompare([]byte(u.Name), []byte(name))
		hashOK := subtle.ConstantTimeCompare(u.hash[:], sum[:])
		if nameOK&hashOK == 1 {
			found, ok = u, 1
		}
	}
	return found, ok == 1
}
