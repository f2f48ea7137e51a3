package console

import (
	"net/http"
	"strconv"

	"github.com/kfn-dev/kfn/operator"
)

// DefaultPageSize is how many rows a page of a list shows by default.
const DefaultPageSize = 100

// pageAt is where a request is in a list: its page (from 1) and the
// server's page size.
type pageAt struct{ number, size int }

// window is the rows a page asks the database for: one more than it
// shows, which tells whether there is a next page.
func (p pageAt) window() operator.Page {
	return operator.Page{Limit: p.size + 1, Offset: (p.number - 1) * p.size}
}

// pager is what a list page shows of where it is: its number and the
// links to the pages before and after it ("" when there is none).
type pager struct {
	Number     int
	Prev, Next string
}

// pageAt reads the page query parameter (1 when absent); anything but a
// positive whole number is a 400.
func (s *Server) pageAt(w http.ResponseWriter, r *http.Request) (pageAt, bool) {
	at := pageAt{number: 1, size: s.cfg.PageSize}
	if v := r.URL.Query().Get("page"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1<<20 {
			http.Error(w, "400 bad request: page is a whole number from 1", http.StatusBadRequest)
			return at, false
		}
		at.number = n
	}
	return at, true
}

// pageOf cuts the rows read through at.window() to the page and links
// its neighbours, keeping the request's other query parameters.
func pageOf[T any](r *http.Request, at pageAt, rows []T) ([]T, pager) {
	p := pager{Number: at.number}
	link := func(n int) string {
		q := r.URL.Query()
		q.Set("page", strconv.Itoa(n))
		return r.URL.Path + "?" + q.Encode()
	}
	if len(rows) > at.size {
		rows, p.Next = rows[:at.size], link(at.number+1)
	}
	if at.number > 1 {
		p.Prev = link(at.number - 1)
	}
	return rows, p
}
