package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
)

var tailHelp = help{
	usage: []string{"kfn tail SUBJECT [--all] [--count N] [--json]"},
	text: `
Prints the events functions emit on SUBJECT (wildcards allowed) as the relay
publishes them to the event stream: the CloudEvents attributes, the key and
the data (as text when it is printable, else base64). It reads with an
ephemeral consumer: it takes nothing from the functions that consume the
stream.`,
	examples: `
kfn tail orders.accepted
kfn tail 'payments.>' --all --json`,
}

// tailedEvent is what kfn tail prints for one event.
type tailedEvent struct {
	Subject    string    `json:"subject"`
	ID         string    `json:"id"`
	Type       string    `json:"type,omitempty"`
	Source     string    `json:"source,omitempty"`
	Time       time.Time `json:"time"`
	Key        string    `json:"key,omitempty"`
	KeyBase64  string    `json:"key_base64,omitempty"`
	Data       string    `json:"data,omitempty"`
	DataBase64 string    `json:"data_base64,omitempty"`
	Sequence   uint64    `json:"stream_sequence"`
}

func runTail(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("tail", tailHelp, stderr)
	natsURL := bind(fs, settings.NATSURL)
	natsSec := bindNATSSecurity(fs)
	stream := bind(fs, settings.EventStream)
	all := fs.Bool("all", false, "start with the oldest event the stream holds (default: only new ones)")
	count := fs.Int("count", 0, "stop after this many events (default: run until Ctrl-C)")
	asJSON := fs.Bool("json", false, "print one JSON object per event")
	pos, err := parsePositional(fs, args, 1, 1, "the subject")
	if err != nil {
		return err
	}
	if err := outbox.CheckSubjectPattern(pos[0]); err != nil {
		return &usageError{msg: err.Error()}
	}
	if err := requiredSetting(settings.NATSURL, *natsURL); err != nil {
		return err
	}
	js, closeNATS, err := connectJetStream(*natsURL, "kfn tail", natsSec)
	if err != nil {
		return err
	}
	defer closeNATS()
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{pos[0]}, DeliverPolicy: jetstream.DeliverNewPolicy}
	if *all {
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	}
	cons, err := js.OrderedConsumer(ctx, *stream, cfg)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("stream %s does not exist yet: it is created when the first function that emits events starts (or set --event-stream)", *stream)
	}
	if err != nil {
		return fmt.Errorf("read stream %s: %w", *stream, err)
	}
	msgs, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("read stream %s: %w", *stream, err)
	}
	stopped := context.AfterFunc(ctx, msgs.Stop)
	defer stopped()
	defer msgs.Stop()
	enc := json.NewEncoder(stdout)
	for n := 0; *count == 0 || n < *count; n++ {
		m, err := msgs.Next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil
			}
			return fmt.Errorf("read stream %s: %w", *stream, err)
		}
		ev := tailed(m)
		if *asJSON {
			if err := enc.Encode(ev); err != nil {
				return err
			}
			continue
		}
		key := ev.Key
		if ev.KeyBase64 != "" {
			key = "base64:" + ev.KeyBase64
		}
		data := ev.Data
		if ev.DataBase64 != "" {
			data = "base64:" + ev.DataBase64
		}
		fmt.Fprintf(stdout, "%s  %s  id=%s  key=%s  %s\n", ev.Time.Format(time.RFC3339Nano), ev.Subject, ev.ID, key, data)
	}
	return nil
}

func tailed(m jetstream.Msg) tailedEvent {
	h := m.Headers()
	ev := tailedEvent{
		Subject: m.Subject(), ID: h.Get(outbox.HeaderID), Type: h.Get(outbox.HeaderType), Source: h.Get(outbox.HeaderSource),
	}
	if md, err := m.Metadata(); err == nil {
		ev.Sequence, ev.Time = md.Sequence.Stream, md.Timestamp
	}
	if t, err := time.Parse(time.RFC3339Nano, h.Get(outbox.HeaderTime)); err == nil {
		ev.Time = t
	}
	if ev.ID == "" {
		ev.ID = h.Get(jetstream.MsgIDHeader)
	}
	if k := h.Get(outbox.HeaderKeyBase64); k != "" {
		ev.KeyBase64 = k
	} else {
		ev.Key = h.Get(outbox.HeaderKey)
	}
	if isText(m.Data()) {
		ev.Data = string(m.Data())
	} else {
		ev.DataBase64 = base64.StdEncoding.EncodeToString(m.Data())
	}
	return ev
}

// isText reports whether b reads as text: valid UTF-8 without control
// characters other than tab and newline.
func isText(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if unicode.IsControl(r) && r != '\t' && r != '\n' {
			return false
		}
	}
	return true
}
