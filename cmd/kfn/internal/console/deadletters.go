package console

import (
	"cmp"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

// groupRef names one dead letter group in a URL or a form.
type groupRef struct {
	Function, Reason, Fingerprint string
}

func (s *Server) deadLetterGroups(w http.ResponseWriter, r *http.Request) {
	at, ok := s.pageAt(w, r)
	if !ok {
		return
	}
	function := r.URL.Query().Get("function")
	groups, err := readOwnRows(s, function, at.window(), func(pool *pgxpool.Pool, page operator.Page) ([]operator.DeadLetterGroup, error) {
		return operator.DeadLetterGroups(r.Context(), pool, function, page)
	}, func(g operator.DeadLetterGroup) string { return g.Function }, func(a, b operator.DeadLetterGroup) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Function, b.Function), cmp.Compare(a.Reason, b.Reason), cmp.Compare(a.Fingerprint, b.Fingerprint))
	})
	groups, pages := pageOf(r, at, groups)
	p := s.newPage(r, "deadletters", "Dead letters", struct {
		Function string
		Groups   []operator.DeadLetterGroup
		Pages    pager
	}{function, groups, pages})
	if err != nil {
		p.Error = problem(err)
	}
	s.render(w, http.StatusOK, "deadletters", p)
}

func (s *Server) deadLetterGroup(w http.ResponseWriter, r *http.Request) {
	at, ok := s.pageAt(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	ref := groupRef{q.Get("function"), q.Get("reason"), q.Get("fp")}
	data := struct {
		Ref     groupRef
		Letters []inbox.DeadLetter
		Pages   pager
	}{Ref: ref}
	p := s.newPage(r, "deadletters", "Dead letter group", nil)
	pool, err := s.poolOf(ref.Function)
	var ids []int64
	if err == nil {
		ids, err = operator.DeadLetterGroupIDs(r.Context(), pool, ref.Function, ref.Reason, ref.Fingerprint, at.window())
	}
	ids, data.Pages = pageOf(r, at, ids)
	if err == nil && len(ids) > 0 {
		data.Letters, err = operator.ListDeadLetters(r.Context(), pool, operator.DeadLetterFilter{IDs: ids, WithoutValue: true})
	}
	if err != nil {
		p.Error = problem(err)
	}
	p.Data = data
	s.render(w, http.StatusOK, "group", p)
}

// headerRow is one header of a record, name and value each shown inertly.
type headerRow struct{ Name, Value shownValue }

func (s *Server) deadLetter(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		http.Error(w, "400 bad request: a dead letter id is a positive number", http.StatusBadRequest)
		return
	}
	function := r.URL.Query().Get("function")
	pool, err := s.letterPool(function)
	var d inbox.DeadLetter
	if err == nil {
		d, err = operator.ShowDeadLetter(r.Context(), pool, id)
	}
	if err == nil && (function != "" && d.Partition.Consumer != function || !s.owns(pool, d.Partition.Consumer)) {
		err = &operator.NotFoundError{IDs: []int64{id}}
	}
	if err != nil {
		p := s.newPage(r, "deadletters", "Dead letter", nil)
		p.Error = problem(err)
		s.render(w, http.StatusNotFound, "message", p)
		return
	}
	value := showBytes(d.Value, d.Value == nil && d.ValueSize == 0)
	if d.ValueSHA256 != nil { // an oversized record: only a prefix was kept
		value.Size, value.SHA256, value.Truncated = int(d.ValueSize), fmt.Sprintf("%x", d.ValueSHA256), true
	}
	headers := make([]headerRow, len(d.Headers))
	for i, h := range d.Headers {
		headers[i] = headerRow{Name: showBytes([]byte(h.Key), false), Value: showBytes(h.Value, h.Value == nil)}
	}
	s.render(w, http.StatusOK, "deadletter", s.newPage(r, "deadletters", fmt.Sprintf("Dead letter %d", d.ID), struct {
		Letter  inbox.DeadLetter
		Key     shownValue
		Value   shownValue
		Headers []headerRow
		TraceID string
	}{d, showBytes(d.Key, d.Key == nil), value, headers, traceID(d.Headers)}))
}

// traceID is the W3C trace id of a record's traceparent header, if any.
func traceID(headers []inbox.Header) string {
	for _, h := range headers {
		if strings.EqualFold(string(h.Key), "traceparent") {
			parts := strings.Split(string(h.Value), "-")
			if len(parts) == 4 && len(parts[1]) == 32 && printable(h.Value) {
				return parts[1]
			}
		}
	}
	return ""
}

// selection is the dead letters a retry or discard form names, in the
// database of its function: the ids ticked, or else a whole group.
type selection struct {
	pool     *pgxpool.Pool
	function string // "" for ids in the console's one database
	ids      []int64
	reason   string // for the audit log
}

func (s *Server) selection(r *http.Request) (selection, error) {
	sel := selection{function: r.PostFormValue("function")}
	for _, v := range r.PostForm["id"] {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil || id < 1 {
			return sel, fmt.Errorf("dead letter id %q is not a positive number", v)
		}
		sel.ids = append(sel.ids, id)
	}
	var err error
	if len(sel.ids) > 0 {
		sel.pool, err = s.letterPool(sel.function)
		return sel, err
	}
	ref := groupRef{sel.function, r.PostFormValue("dead_reason"), r.PostFormValue("fp")}
	if ref.Function == "" || ref.Reason == "" {
		return sel, fmt.Errorf("say which dead letters: tick them, or act on a whole group")
	}
	if sel.pool, err = s.poolOf(ref.Function); err != nil {
		return sel, err
	}
	sel.ids, err = operator.DeadLetterGroupIDs(r.Context(), sel.pool, ref.Function, ref.Reason, ref.Fingerprint, operator.Page{})
	if err == nil && len(sel.ids) == 0 {
		err = fmt.Errorf("the group is empty now (retried or discarded already?)")
	}
	return sel, err
}

// selectionWithReason is what a retry or discard form asks for: the
// dead letters it selects and the reason for the audit log. When either
// is missing it answers 400 on page p and returns false.
func (s *Server) selectionWithReason(w http.ResponseWriter, r *http.Request, p *page) (selection, bool) {
	sel, err := s.selection(r)
	sel.reason = strings.TrimSpace(r.PostFormValue("reason"))
	if err == nil && sel.reason == "" {
		err = fmt.Errorf("say why, for the audit log: the reason is required")
	}
	if err != nil {
		p.Error = err.Error()
		s.render(w, http.StatusBadRequest, "message", *p)
		return sel, false
	}
	return sel, true
}

// retry marks the selected dead letters for retry with operator.Retry, as
// kfn dlq retry does, the console user as the actor.
func (s *Server) retry(w http.ResponseWriter, r *http.Request) {
	p := s.newPage(r, "deadletters", "Retry", nil)
	sel, ok := s.selectionWithReason(w, r, &p)
	if !ok {
		return
	}
	marks, err := operator.Retry(r.Context(), sel.pool, operator.RetryRequest{Function: sel.function, IDs: sel.ids, Limit: len(sel.ids), Partition: -1,
		Reason: sel.reason, Actor: who(r).Actor()})
	if err != nil {
		p.Error = problem(err)
		s.render(w, http.StatusBadRequest, "message", p)
		return
	}
	s.cfg.Log.Info("console retry", "actor", who(r).Actor(), "marked", len(marks.Marked), "refused", len(marks.Refused))
	p.Notice = fmt.Sprintf("Marked %d dead letters for retry as %s; the workers that own their lanes apply them in a few seconds.", len(marks.Marked), who(r).Actor())
	p.Data = marks
	s.render(w, http.StatusOK, "retried", p)
}

// discard deletes the selected dead letters with
// operator.DiscardDeadLetters, as kfn dlq discard does.
func (s *Server) discard(w http.ResponseWriter, r *http.Request) {
	p := s.newPage(r, "deadletters", "Discard", nil)
	sel, ok := s.selectionWithReason(w, r, &p)
	if !ok {
		return
	}
	res, err := operator.DiscardDeadLetters(r.Context(), sel.pool, operator.DiscardRequest{Filter: operator.DeadLetterFilter{Consumer: sel.function, IDs: sel.ids},
		Reason: sel.reason, Actor: who(r).Actor()})
	if err != nil {
		p.Error = problem(err)
		s.render(w, http.StatusBadRequest, "message", p)
		return
	}
	s.cfg.Log.Info("console discard", "actor", who(r).Actor(), "discarded", len(res.DeadLetters))
	p.Notice = fmt.Sprintf("Discarded %d dead letters as %s (released %d parked keys).", len(res.DeadLetters), who(r).Actor(), len(res.Released))
	s.render(w, http.StatusOK, "message", p)
}

func (s *Server) parkedKeys(w http.ResponseWriter, r *http.Request) {
	at, ok := s.pageAt(w, r)
	if !ok {
		return
	}
	function := r.URL.Query().Get("function")
	keys, err := readOwnRows(s, function, at.window(), func(pool *pgxpool.Pool, page operator.Page) ([]operator.ParkedKey, error) {
		return operator.ParkedKeys(r.Context(), pool, function, page)
	}, func(k operator.ParkedKey) string { return k.Partition.Consumer }, func(a, b operator.ParkedKey) int {
		return cmp.Or(a.ParkedAt.Compare(b.ParkedAt), cmp.Compare(a.Partition.Consumer, b.Partition.Consumer),
			cmp.Compare(a.Partition.Topic, b.Partition.Topic), cmp.Compare(a.Partition.Partition, b.Partition.Partition))
	})
	keys, pages := pageOf(r, at, keys)
	p := s.newPage(r, "parked", "Parked keys", struct {
		Keys  []operator.ParkedKey
		Pages pager
	}{keys, pages})
	if err != nil {
		p.Error = problem(err)
	}
	s.render(w, http.StatusOK, "parked", p)
}
