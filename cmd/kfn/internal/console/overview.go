package console

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
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

// readOverview reads everything the overview shows, from every database:
// the lanes through the same operator.StatusReader as kfn status, the dead
// letters of the last hour, the parked keys and the relay's backlog.
func (s *Server) readOverview(ctx context.Context) overviewData {
	start := time.Now()
	d := overviewData{ReadAt: start}
	// Kafka and NATS (the lanes) are asked while Postgres counts.
	pools := s.databases()
	lanes := make([][]operator.PartitionStatus, len(pools))
	statusErrs := make([]error, len(pools))
	var wg sync.WaitGroup
	for i, reader := range s.statuses {
		wg.Go(func() { lanes[i], statusErrs[i] = reader.Read(ctx, "") })
	}
	var errs []error
	for _, pool := range pools {
		total, lastHour, err := operator.DeadLetterCounts(ctx, pool, start.Add(-time.Hour))
		d.DeadTotal, d.DeadLastHour, errs = d.DeadTotal+total, d.DeadLastHour+lastHour, append(errs, err)
		parked, err := operator.ParkedKeys(ctx, pool, "", operator.Page{})
		for _, k := range parked {
			if s.owns(pool, k.Partition.Consumer) {
				d.ParkedKeys++
			}
		}
		errs = append(errs, err)
		backlog, err := operator.ReadRelayBacklog(ctx, pool)
		d.Backlog.Events, errs = d.Backlog.Events+backlog.Events, append(errs, err)
		if !backlog.Oldest.IsZero() && (d.Backlog.Oldest.IsZero() || backlog.Oldest.Before(d.Backlog.Oldest)) {
			d.Backlog.Oldest = backlog.Oldest
		}
	}
	wg.Wait()
	var all []operator.PartitionStatus
	for i, pool := range pools {
		if statusErrs[i] != nil {
			d.Problems = append(d.Problems, problem(statusErrs[i]))
		}
		for _, l := range lanes[i] {
			if s.owns(pool, l.Function) {
				all = append(all, l)
			}
		}
	}
	slices.SortStableFunc(all, func(a, b operator.PartitionStatus) int {
		return cmp.Or(cmp.Compare(a.Function, b.Function), cmp.Compare(a.Topic, b.Topic), cmp.Compare(a.Partition, b.Partition))
	})
	d.Lanes = s.rates.annotate(all, start)
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
