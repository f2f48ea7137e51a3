package console

import (
	"net/http"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/operator/verify"
)

// verify runs operator/verify on a function, as kfn verify does (read-only),
// and shows its verdict and violations.
func (s *Server) verify(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	function, topic := strings.TrimSpace(q.Get("function")), strings.TrimSpace(q.Get("topic"))
	p := s.newPage(r, "verify", "Verify", nil)
	var report *verify.Report
	var table string
	if function != "" || topic != "" {
		rep, err := verify.Run(r.Context(), s.cfg.Pool, s.cfg.JS, verify.Spec{Function: function, Topic: topic, UnpublishedAfter: time.Minute,
			Examples: 5, KafkaBrokers: s.cfg.KafkaBrokers, KafkaSecurity: s.cfg.KafkaSecurity, Stream: s.cfg.EventStream})
		if err != nil {
			p.Error = problem(err)
		} else {
			report = rep
			var sb strings.Builder
			if err := rep.WriteTable(&sb); err != nil {
				p.Error = problem(err)
			}
			table = sb.String()
		}
	}
	p.Data = struct {
		Function, Topic string
		Report          *verify.Report
		Table           string
	}{function, topic, report, table}
	s.render(w, http.StatusOK, "verify", p)
}
