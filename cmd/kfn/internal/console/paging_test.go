package console

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/dlqtest"
)

// TestListsPageThroughEveryRow walks the dead letter groups, a group's
// letters and the audit log two rows a page: every row shows on exactly
// one page, in order, and the links go back and forth with the filters
// kept. A page number that is not a whole number from 1 is a 400.
func TestListsPageThroughEveryRow(t *testing.T) {
	st := setup(t, func(c *Config) { c.PageSize = 2 })
	// Three more groups of "orders" (the setup made two), and the first
	// group grows to three letters.
	var more []dlqtest.Letter
	for i := range 3 {
		more = append(more, dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 2, Offset: int64(20 + i), Reason: "handler_error", Error: fmt.Sprintf("currency %c is unknown", 'A'+i)})
	}
	more = append(more, dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 3, Offset: 30, Reason: "handler_error", Error: "order 5 not found"})
	dlqtest.Seed(t, st.db.Pool, more...)
	for i := range 5 {
		if _, err := st.db.Pool.Exec(context.Background(), `INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition) VALUES ($1, 'purge', 'orders', 'orders', 0)`, fmt.Sprintf("actor-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	c := client(t)
	login(t, c, st.srv.URL, "victor", "victor-secret")

	// walk follows the Next links from path and returns what each page
	// showed (by pattern), page by page.
	walk := func(path string, row *regexp.Regexp) [][]string {
		t.Helper()
		var pages [][]string
		for n := 1; path != ""; n++ {
			code, body := get(t, c, st.srv.URL, path)
			if code != http.StatusOK {
				t.Fatalf("%s: %d\n%s", path, code, body)
			}
			if !strings.Contains(body, fmt.Sprintf(`<span class="page">Page %d</span>`, n)) {
				t.Fatalf("%s does not say it is page %d:\n%s", path, n, body)
			}
			if prev := strings.Contains(body, `rel="prev"`); prev != (n > 1) {
				t.Errorf("%s: a link to the page before: %v on page %d", path, prev, n)
			}
			var shown []string
			for _, m := range row.FindAllStringSubmatch(body, -1) {
				shown = append(shown, m[1])
			}
			pages = append(pages, shown)
			next := regexp.MustCompile(`href="([^"]+)" rel="next"`).FindStringSubmatch(body)
			path = ""
			if next != nil {
				path = html.UnescapeString(next[1]) // as a browser reads the attribute
			}
			if n > 10 {
				t.Fatalf("more than 10 pages from %s", path)
			}
		}
		return pages
	}

	groups := walk("/deadletters?function=orders", regexp.MustCompile(`<a class="group" href="[^"]*">([^<]*)</a>`))
	if fmt.Sprint(groups) != "[[order &lt;n&gt; not found currency A is unknown] [currency B is unknown currency C is unknown] [bad currency]]" {
		t.Errorf("dead letter groups by page: %v; want the 5 groups, the largest first (then by reason and fingerprint), 2 a page", groups)
	}
	letters := walk("/deadletters/group?function=orders&reason=handler_error&fp=order+%3Cn%3E+not+found", regexp.MustCompile(`<tr data-id="(\d+)">`))
	if len(letters) != 2 || len(letters[0]) != 2 || len(letters[1]) != 1 {
		t.Errorf("the group's letters by page: %v; want 2 then 1", letters)
	}
	audit := walk("/audit?action=purge", regexp.MustCompile(`<td class="actor">([^<]*)</td>`))
	if fmt.Sprint(audit) != "[[actor-4 actor-3] [actor-2 actor-1] [actor-0]]" {
		t.Errorf("the audit log by page: %v; want the 5 rows newest first, 2 a page, the filter kept", audit)
	}
	for _, bad := range []string{"0", "-1", "x", "1.5"} {
		if code, _ := get(t, c, st.srv.URL, "/deadletters?page="+bad); code != http.StatusBadRequest {
			t.Errorf("page=%s: %d, want 400", bad, code)
		}
	}
}
