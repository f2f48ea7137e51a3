package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

// replayForm is what the replay form holds, as typed.
type replayForm struct {
	Function, Topic, Partition, From, To, Reason string
	Reexecute, KeepEventIDs                      bool
}

func readReplayForm(v url.Values) replayForm {
	return replayForm{Function: strings.TrimSpace(v.Get("function")), Topic: strings.TrimSpace(v.Get("topic")),
		Partition: strings.TrimSpace(v.Get("partition")), From: strings.TrimSpace(v.Get("from")), To: strings.TrimSpace(v.Get("to")),
		Reason: strings.TrimSpace(v.Get("reason")), Reexecute: v.Get("reexecute") == "on", KeepEventIDs: v.Get("keep_event_ids") == "on"}
}

// spec checks the form as kfn replay checks its flags.
func (s *Server) spec(f replayForm, actor string, dryRun bool) (operator.ReplaySpec, error) {
	spec := operator.ReplaySpec{Function: f.Function, Topic: f.Topic, LeaseBucket: s.cfg.LeaseBucket, KafkaBrokers: s.cfg.KafkaBrokers,
		KafkaSecurity: s.cfg.KafkaSecurity, DryRun: dryRun,
		ReplayOptions: inbox.ReplayOptions{Reexecute: f.Reexecute, KeepEventIDs: f.KeepEventIDs, Reason: f.Reason, Actor: actor}}
	number := func(name, v string) (int64, error) {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("%s %q: give an offset, 0 or more", name, v)
		}
		return n, nil
	}
	var err error
	switch {
	case f.Function == "" || f.Topic == "":
		return spec, errors.New("the function and the topic are required")
	case f.From == "":
		return spec, errors.New("the offset to replay from is required")
	case len(s.cfg.KafkaBrokers) == 0:
		return spec, errors.New("a replay is checked against Kafka: start the console with --kafka-brokers")
	case f.Reexecute && f.Reason == "":
		return spec, errors.New("a re-execution applies records a second time: say why (the reason is required)")
	case f.KeepEventIDs && !f.Reexecute:
		return spec, errors.New("keeping the event ids is a choice of a re-execution")
	}
	if spec.From, err = number("from", f.From); err != nil {
		return spec, err
	}
	if f.To != "" {
		if spec.To, err = number("to", f.To); err != nil {
			return spec, err
		}
	}
	if f.Partition != "" {
		n, err := strconv.ParseInt(f.Partition, 10, 32)
		if err != nil || n < 0 {
			return spec, fmt.Errorf("partition %q: give a number, 0 or more, or leave it empty for every partition", f.Partition)
		}
		spec.Partitions = []int32{int32(n)}
	}
	return spec, nil
}

type replayData struct {
	Form    replayForm
	Planned bool
	Done    bool
	Plans   []operator.PartitionReplay
	Cursors map[int32]int64
}

// replayForm shows the form and, asked for a plan, the dry run's plan (the
// same operator.ReplayPartitions as kfn replay --dry-run), with a form to
// confirm it.
func (s *Server) replayForm(w http.ResponseWriter, r *http.Request) {
	f := readReplayForm(r.URL.Query())
	data := replayData{Form: f}
	p := s.newPage(r, "replay", "Replay", nil)
	if r.URL.Query().Get("plan") != "" {
		spec, err := s.spec(f, who(r).Actor(), true)
		if err == nil {
			data.Plans, err = s.replayPartitions(r.Context(), spec)
		}
		if err != nil {
			p.Error = problem(err)
		} else {
			data.Planned = true
		}
	}
	p.Data = data
	s.render(w, http.StatusOK, "replay", p)
}

// replayPartitions plans (a dry run) or runs spec with
// operator.ReplayPartitions in its function's database.
func (s *Server) replayPartitions(ctx context.Context, spec operator.ReplaySpec) ([]operator.PartitionReplay, error) {
	pool, err := s.poolOf(spec.Function)
	if err != nil {
		return nil, err
	}
	return operator.ReplayPartitions(ctx, pool, s.cfg.JS, spec)
}

// replay runs the confirmed replay, the console user as the actor.
func (s *Server) replay(w http.ResponseWriter, r *http.Request) {
	f := readReplayForm(r.PostForm)
	data := replayData{Form: f}
	p := s.newPage(r, "replay", "Replay", nil)
	spec, err := s.spec(f, who(r).Actor(), false)
	if err == nil && s.cfg.JS == nil {
		err = errors.New("a replay takes the partition's lease: start the console with --nats-url")
	}
	if err == nil {
		data.Plans, err = s.replayPartitions(r.Context(), spec)
	}
	status := http.StatusOK
	if err != nil {
		p.Error = problem(err)
		status = http.StatusBadRequest
	} else {
		data.Done = true
		s.cfg.Log.Info("console replay", "actor", who(r).Actor(), "function", f.Function, "topic", f.Topic, "partitions", len(data.Plans))
		p.Notice = fmt.Sprintf("Replayed %d partitions as %s; the workers resume at the new cursors.", len(data.Plans), who(r).Actor())
	}
	p.Data = data
	s.render(w, status, "replay", p)
}
