package console

import (
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/operator/verify"
)

// verify runs operator/verify on a function, in the function's own
// database, as kfn verify does (read-only), over the whole source or a
// range of it (partitions, from, to: as kfn verify's flags take them), and
// shows its verdict, the range checked and the violations.
func (s *Server) verify(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	form := verifyForm{Function: strings.TrimSpace(q.Get("function")), Topic: strings.TrimSpace(q.Get("topic")),
		Partitions: strings.TrimSpace(q.Get("partitions")), From: strings.TrimSpace(q.Get("from")), To: strings.TrimSpace(q.Get("to"))}
	p := s.newPage(r, "verify", "Verify", nil)
	var report *verify.Report
	var table string
	if form.Function != "" || form.Topic != "" {
		spec, err := form.spec(time.Now())
		var rep *verify.Report
		if err == nil {
			spec.UnpublishedAfter, spec.Examples, spec.Stream = time.Minute, 5, s.cfg.EventStream
			spec.KafkaBrokers, spec.KafkaSecurity = s.cfg.KafkaBrokers, s.cfg.KafkaSecurity
			var pool *pgxpool.Pool
			if pool, err = s.poolOf(spec.Function); err == nil {
				rep, err = verify.Run(r.Context(), pool, s.cfg.JS, spec)
			}
		}
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
		verifyForm
		Report *verify.Report
		Table  string
	}{form, report, table}
	s.render(w, http.StatusOK, "verify", p)
}

// verifyForm is the verify page's form, as given.
type verifyForm struct {
	Function, Topic, Partitions, From, To string
}

// spec reads the form's function and range into a Spec; a bad range is a
// verify.SpecError naming its field.
func (f verifyForm) spec(now time.Time) (verify.Spec, error) {
	spec := verify.Spec{Function: f.Function, Topic: f.Topic}
	var err error
	if spec.Partitions, err = verify.ParsePartitions(f.Partitions); err != nil {
		return spec, err
	}
	if spec.From, err = verify.ParseBound("from", f.From, now); err != nil {
		return spec, err
	}
	spec.To, err = verify.ParseBound("to", f.To, now)
	return spec, err
}
