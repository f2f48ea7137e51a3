package console

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// shownBytes bounds how much of one value a page shows; the size and the
// SHA-256 always cover the whole value.
const shownBytes = 64 << 10

// shownValue is one key, value or header of a record, as a page shows it:
// Kind says how (json, text, hex or null), Text is what is shown, Size
// and SHA256 describe the whole.
type shownValue struct {
	Kind      string
	Text      string
	Size      int
	SHA256    string
	Truncated bool
}

// showBytes decides how b is shown: pretty-printed JSON, text when it is
// valid UTF-8 without control characters (tabs and newlines aside), else
// hex. html/template escapes whatever Text holds.
func showBytes(b []byte, null bool) shownValue {
	if null {
		return shownValue{Kind: "null"}
	}
	sum := sha256.Sum256(b)
	v := shownValue{Size: len(b), SHA256: hex.EncodeToString(sum[:])}
	part := b
	if len(part) > shownBytes {
		part, v.Truncated = part[:shownBytes], true
	}
	switch {
	case !v.Truncated && len(b) > 0 && (b[0] == '{' || b[0] == '[') && json.Valid(b) && printable(b):
		var out bytes.Buffer
		if json.Indent(&out, b, "", "  ") == nil {
			v.Kind, v.Text = "json", out.String()
			return v
		}
	case printable(part):
		v.Kind, v.Text = "text", string(part)
		return v
	}
	v.Kind, v.Text = "hex", hexDump(part)
	return v
}

// printable: valid UTF-8 with no control character but tab, newline and
// carriage return (a cut in the middle of a rune at shownBytes aside).
func printable(b []byte) bool {
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r == utf8.RuneError && n <= 1 {
			return len(b) < utf8.UTFMax && !utf8.FullRune(b)
		}
		if r != '\n' && r != '\t' && r != '\r' && (unicode.IsControl(r) || r == '\u2028' || r == '\u2029' || unicode.Is(unicode.Bidi_Control, r)) {
			return false
		}
		b = b[n:]
	}
	return true
}

// hexDump is b as lines of 16 bytes: offset, hex, and the printable ASCII.
func hexDump(b []byte) string {
	var sb strings.Builder
	for off := 0; off < len(b); off += 16 {
		line := b[off:min(off+16, len(b))]
		fmt.Fprintf(&sb, "%08x  %-48s |", off, spacedHex(line))
		for _, c := range line {
			if c < 0x20 || c > 0x7e {
				c = '.'
			}
			sb.WriteByte(c)
		}
		sb.WriteString("|\n")
	}
	return sb.String()
}

func spacedHex(b []byte) string {
	var sb strings.Builder
	for i, c := range b {
		if i > 0 {
			sb.WriteByte(' ')
		}
		fmt.Fprintf(&sb, "%02x", c)
	}
	return sb.String()
}

// inline is bytes in one table cell: text when printable, else hex,
// and at most 80 characters.
func inline(b []byte) string {
	if b == nil {
		return "null"
	}
	s := string(b)
	if !printable(b) {
		s = "0x" + hex.EncodeToString(b)
	}
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return strings.ToValidUTF8(s, "�")
}

// ago is how long before now t was, rounded for a person.
func ago(t time.Time) string {
	if t.IsZero() || t.Unix() <= 0 {
		return "never"
	}
	d := time.Since(t)
	switch {
	case d < 0:
		return "just now"
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%.1fh ago", d.Hours())
	}
	return fmt.Sprintf("%dd ago", int(d.Hours()/24))
}

var funcs = template.FuncMap{
	"ago":    ago,
	"inline": inline,
	"when": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
}

// parsePages parses each page with the shared layout.
func parsePages() (map[string]*template.Template, error) {
	names, err := templateFS.ReadDir("templates")
	if err != nil {
		return nil, err
	}
	pages := map[string]*template.Template{}
	for _, e := range names {
		name := strings.TrimSuffix(e.Name(), ".html")
		if name == "layout" {
			continue
		}
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+e.Name())
		if err != nil {
			return nil, err
		}
		pages[name] = t
	}
	return pages, nil
}
