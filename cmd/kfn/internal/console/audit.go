package console

import (
	"cmp"
	"encoding/json"
	"net/http"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

type auditRow struct {
	inbox.AuditEntry
	Details string
}

// audit shows kfn.audit_log through operator.AuditLog, as kfn audit does,
// filtered by actor, action, function and time.
func (s *Server) audit(w http.ResponseWriter, r *http.Request) {
	at, ok := s.pageAt(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	window := at.window()
	f := operator.AuditFilter{Consumer: q.Get("function"), Action: q.Get("action"), ActorContains: q.Get("actor")}
	p := s.newPage(r, "audit", "Audit log", nil)
	err := operator.CheckAuditAction(f.Action)
	if err == nil && q.Get("since") != "" {
		var d time.Duration
		if d, err = time.ParseDuration(q.Get("since")); err == nil {
			f.Since = time.Now().Add(-d)
		}
	}
	var pools []*pgxpool.Pool
	if err == nil {
		pools, err = s.databasesOf(f.Consumer)
	}
	var entries []inbox.AuditEntry
	if err == nil {
		// Newest first, from every database when no function is given,
		// as kfn audit reads them.
		entries, err = readPage(pools, window, func(pool *pgxpool.Pool, page operator.Page) ([]inbox.AuditEntry, error) {
			f.Limit, f.Offset = page.Limit, page.Offset
			these, err := operator.AuditLog(r.Context(), pool, f)
			slices.Reverse(these)
			return these, err
		}, nil, func(a, b inbox.AuditEntry) int { return cmp.Or(b.At.Compare(a.At), cmp.Compare(b.ID, a.ID)) })
	}
	if err != nil {
		p.Error = problem(err)
	}
	entries, pages := pageOf(r, at, entries)
	rows := make([]auditRow, len(entries))
	for i, e := range entries {
		var details map[string]any
		text := string(e.Details)
		if json.Unmarshal(e.Details, &details) == nil {
			if b, err := json.Marshal(details); err == nil {
				text = string(b)
			}
		}
		rows[i] = auditRow{AuditEntry: e, Details: text}
	}
	p.Data = struct {
		Function, Action, Actor, Since string
		Actions                        []string
		Rows                           []auditRow
		Pages                          pager
	}{f.Consumer, f.Action, f.ActorContains, q.Get("since"), operator.AuditActions, rows, pages}
	s.render(w, http.StatusOK, "audit", p)
}
