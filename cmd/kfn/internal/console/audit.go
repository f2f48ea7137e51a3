package console

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"

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
	q := r.URL.Query()
	f := operator.AuditFilter{Consumer: q.Get("function"), Action: q.Get("action"), ActorContains: q.Get("actor"), Limit: 200}
	p := s.newPage(r, "audit", "Audit log", nil)
	err := operator.CheckAuditAction(f.Action)
	if err == nil && q.Get("since") != "" {
		var d time.Duration
		if d, err = time.ParseDuration(q.Get("since")); err == nil {
			f.Since = time.Now().Add(-d)
		}
	}
	if n, e := strconv.Atoi(q.Get("limit")); e == nil && n > 0 && n <= 5000 {
		f.Limit = n
	}
	var entries []inbox.AuditEntry
	if err == nil {
		entries, err = operator.AuditLog(r.Context(), s.cfg.Pool, f)
	}
	if err != nil {
		p.Error = problem(err)
	}
	rows := make([]auditRow, len(entries))
	for i := range entries { // newest first
		e := entries[len(entries)-1-i]
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
	}{f.Consumer, f.Action, f.ActorContains, q.Get("since"), operator.AuditActions, rows}
	s.render(w, http.StatusOK, "audit", p)
}
