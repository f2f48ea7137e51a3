package console

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"golang.org/x/net/html"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/dlqtest"
)

// hostile is a record whose every part is an attack on the page that shows
// it: script and HTML payloads, invalid UTF-8, NUL.
var hostile = dlqtest.Letter{
	Function: "orders", Topic: "orders", Partition: 2, Offset: 40, Reason: "data_error",
	Error: `bad record "><img src=x onerror=alert(3)> <script>alert(4)</script>`,
	Key:   []byte(`<script>alert(1)</script>`),
	Value: []byte("\"><img src=x onerror=alert(2)>\xff\xfe\x00<script>alert(5)</script>"),
	Headers: []inbox.Header{
		{Key: []byte("<script>alert(6)</script>"), Value: []byte(`"><img src=x onerror=alert(7)>`)},
		{Key: []byte("\"><img src=x onerror=alert(8)>"), Value: []byte("nul\x00in value")},
		{Key: []byte("bad\xffname"), Value: nil},
		{Key: []byte("nul\x00name"), Value: []byte(`<svg onload=alert(9)>`)},
		{Key: []byte("traceparent"), Value: []byte("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")},
	},
}

// oneMB is a 1 MB value made of script tags.
var oneMB = dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 2, Offset: 41, Reason: "data_error", Error: "too big",
	Key: []byte("big"), Value: bytes.Repeat([]byte("<script>alert(10)</script>"), 1<<20/26+1)[:1<<20]}

// inertPage parses body as HTML and fails t for every element or attribute
// a record could have injected: a script other than the console's own,
// an img, svg or iframe, any on* event handler attribute.
func inertPage(t *testing.T, what, body string) *html.Node {
	t.Helper()
	doc, err := html.Parse(strings.NewReader(body))
	if err != nil {
		t.Fatalf("%s: parse: %v", what, err)
	}
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.ElementNode {
			switch n.Data {
			case "script":
				if len(n.Attr) != 2 || n.Attr[0].Val != "/static/console.js" || n.FirstChild != nil {
					t.Errorf("%s: an injected script element: %v", what, n.Attr)
				}
			case "img", "svg", "iframe", "object", "embed":
				t.Errorf("%s: an injected %s element: %v", what, n.Data, n.Attr)
			}
			for _, a := range n.Attr {
				if strings.HasPrefix(strings.ToLower(a.Key), "on") {
					t.Errorf("%s: an event handler attribute %s=%q on %s", what, a.Key, a.Val, n.Data)
				}
			}
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	walk(doc)
	return doc
}

// text is the text content of the element with the given id.
func text(doc *html.Node, id string) string {
	var found *html.Node
	var find func(*html.Node)
	find = func(n *html.Node) {
		for _, a := range n.Attr {
			if a.Key == "id" && a.Val == id {
				found = n
			}
		}
		for c := n.FirstChild; c != nil && found == nil; c = c.NextSibling {
			find(c)
		}
	}
	find(doc)
	if found == nil {
		return ""
	}
	var sb strings.Builder
	var collect func(*html.Node)
	collect = func(n *html.Node) {
		if n.Type == html.TextNode {
			sb.WriteString(n.Data)
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			collect(c)
		}
	}
	collect(found)
	return sb.String()
}

func TestHostileRecordBytesRenderAsInertText(t *testing.T) {
	st := setup(t, nil)
	ids := dlqtest.Seed(t, st.db.Pool, hostile, oneMB)
	err := pgx.BeginFunc(context.Background(), st.db.Pool, func(tx pgx.Tx) error {
		return inbox.ParkKey(context.Background(), tx, inbox.Partition{Consumer: "orders", Topic: "orders", Partition: 2}, hostile.Key, hostile.Offset)
	})
	if err != nil {
		t.Fatal(err)
	}
	c := client(t)
	login(t, c, st.srv.URL, "alice", "alice-secret")

	code, body := get(t, c, st.srv.URL, "/deadletters/"+itoa(ids[0]))
	if code != http.StatusOK {
		t.Fatalf("detail page: %d\n%s", code, body)
	}
	doc := inertPage(t, "detail page", body)
	// The payloads are there, as text: the key is printable, so shown as it is.
	if got := text(doc, "key"); !strings.Contains(got, `<script>alert(1)</script>`) {
		t.Errorf("the key's text is not on the page: %q", got)
	}
	if got := text(doc, "error"); !strings.Contains(got, `"><img src=x onerror=alert(3)>`) {
		t.Errorf("the error's text is not on the page: %q", got)
	}
	// The value holds invalid UTF-8 and NUL: hex, with its size and SHA-256.
	value := text(doc, "value")
	for _, want := range []string{"hex, 58 bytes", "29 3e ff fe", "00000020  00 3c 73 63", "|\"><img src=x one|"} {
		if !strings.Contains(value, want) {
			t.Errorf("the value's hex view lacks %q:\n%s", want, value)
		}
	}
	headers := text(doc, "headers")
	for _, want := range []string{"<script>alert(6)</script>", `"><img src=x onerror=alert(7)>`, "62 61 64 ff 6e 61 6d 65", "6e 75 6c 00 6e 61 6d 65", "<svg onload=alert(9)>"} {
		if !strings.Contains(headers, want) {
			t.Errorf("the headers lack %q:\n%s", want, headers)
		}
	}
	if !strings.Contains(body, "4bf92f3577b34da6a3ce929d0e0e4736") {
		t.Error("the trace id is not shown")
	}

	code, body = get(t, c, st.srv.URL, "/deadletters/"+itoa(ids[1]))
	if code != http.StatusOK {
		t.Fatalf("1 MB detail page: %d", code)
	}
	doc = inertPage(t, "1 MB detail page", body)
	value = text(doc, "value")
	if !strings.Contains(value, "text, 1048576 bytes") || !strings.Contains(value, "the first bytes shown") || !strings.Contains(value, "<script>alert(10)</script>") {
		t.Errorf("the 1 MB value's view: %.300q", value)
	}
	if len(body) > 2*shownBytes+64<<10 {
		t.Errorf("the 1 MB value's page is %d bytes: the view is not bounded", len(body))
	}

	// The lists show the hostile key and error too.
	for _, path := range []string{"/deadletters", "/deadletters/group?function=orders&reason=data_error&fp=" + "bad+record+%22%3E%3Cimg+src%3Dx+onerror%3Dalert%28%3Cn%3E%29%3E+%3Cscript%3Ealert%28%3Cn%3E%29%3C%2Fscript%3E", "/parked", "/audit"} {
		code, body := get(t, c, st.srv.URL, path)
		if code != http.StatusOK {
			t.Fatalf("GET %s: %d", path, code)
		}
		inertPage(t, path, body)
		if path != "/audit" && !strings.Contains(body, "&lt;script&gt;alert(") {
			t.Errorf("GET %s does not show the hostile key or error escaped", path)
		}
	}
}
