package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/kfn-dev/kfn/operator"
)

// overviewData is the overview's live part.
type overviewData struct {
	Lanes        []laneRow
	DeadLastHour int64
	DeadTotal    int64
	ParkedKeys   int
	Backlog      operator.RelayBacklog
	Problems     []string
	ReadAt       time.Time
	ReadMillis   int64
}

// laneRow is one lane on the overview.
type laneRow struct {
	operator.PartitionStatus
	Rate string // commits (cursor moves) per second since the last refresh; "" before a second one
}

// readOverview reads everything the overview shows: the lanes through the
// same operator.StatusReader as kfn status, the dead letters of the last
// hour, the parked keys and the relay's backlog.
func (s *Server) readOverview(ctx context.Context) overviewData {
	start := time.Now()
	d := overviewData{ReadAt: start}
	// Kafka and NATS (the lanes) are asked while Postgres counts.
	var lanes []operator.PartitionStatus
	var statusErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		lanes, statusErr = s.status.Read(ctx, "")
	}()
	var errs []error
	var e error
	d.DeadTotal, d.DeadLastHour, e = operator.DeadLetterCounts(ctx, s.cfg.Pool, start.Add(-time.Hour))
	errs = append(errs, e)
	parked, e := operator.ParkedKeys(ctx, s.cfg.Pool, "", operator.Page{})
	d.ParkedKeys = len(parked)
	errs = append(errs, e)
	d.Backlog, e = operator.ReadRelayBacklog(ctx, s.cfg.Pool)
	errs = append(errs, e)
	<-done
	if statusErr != nil {
		d.Problems = append(d.Problems, problem(statusErr))
	}
	d.Lanes = s.rates.annotate(lanes, start)
	if err := errors.Join(errs...); err != nil {
		d.Problems = append(d.Problems, problem(err))
	}
	d.ReadMillis = time.Since(start).Milliseconds()
	return d
}

func (s *Server) overview(w http.ResponseWriter, r *http.Request) {
	s.render(w, http.StatusOK, "overview", s.newPage(r, "overview", "Overview", s.readOverview(r.Context())))
}

// overviewLive is the overview's live part alone, which console.js fetches
// every few seconds and puts in place of the old one.
func (s *Server) overviewLive(w http.ResponseWriter, r *http.Request) {
	p := s.newPage(r, "overview", "Overview", s.readOverview(r.Context()))
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := s.pages["overview"].ExecuteTemplate(w, "live", p); err != nil {
		s.cfg.Log.Error("render", "page", "overview live", "err", err)
	}
}

// rates remembers each lane's cursor at the previous refresh, to show how
// fast it moves.
type rates struct {
	mu   sync.Mutex
	last map[string]rateSample
}

type rateSample struct {
	cursor int64
	at     time.Time
	rate   string
}

func (rs *rates) annotate(lanes []operator.PartitionStatus, now time.Time) []laneRow {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.last == nil {
		rs.last = map[string]rateSample{}
	}
	rows := make([]laneRow, len(lanes))
	for i, l := range lanes {
		key := fmt.Sprintf("%s\x00%s\x00%d", l.Function, l.Topic, l.Partition)
		prev, ok := rs.last[key]
		rows[i] = laneRow{PartitionStatus: l}
		switch {
		case !ok:
			rs.last[key] = rateSample{cursor: l.Cursor, at: now}
		case now.Sub(prev.at) < time.Second: // too soon to say: keep the last figure
			rows[i].Rate = prev.rate
		default:
			rate := fmt.Sprintf("%.1f/s", float64(l.Cursor-prev.cursor)/now.Sub(prev.at).Seconds())
			rs.last[key] = rateSample{cursor: l.Cursor, at: now, rate: rate}
			rows[i].Rate = rate
		}
	}
	return rows
}
