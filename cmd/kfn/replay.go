package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/user"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
)

func runReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("replay", stderr)
	dbURL := bind(fs, settings.DatabaseURL)
	natsURL := bind(fs, settings.NATSURL)
	function := fs.String("function", "", "the function whose cursor moves (required)")
	topic := fs.String("topic", "", "the source topic (required)")
	partition := fs.Int("partition", -1, "the partition (required)")
	from := fs.Int64("from-offset", -1, "resume at this offset (required)")
	reexecute := fs.Bool("reexecute", false, "apply already handled records again (audited; needs --reason)")
	reason := fs.String("reason", "", "why, for the audit log")
	bucket := bind(fs, settings.LeaseBucket)
	if err := parse(fs, args); err != nil {
		return err
	}
	for _, err := range []error{requiredSetting(settings.DatabaseURL, *dbURL), requiredSetting(settings.NATSURL, *natsURL)} {
		if err != nil {
			return err
		}
	}
	for name, v := range map[string]string{"function": *function, "topic": *topic} {
		if err := required(name, v); err != nil {
			return err
		}
	}
	if *partition < 0 {
		return &usageError{msg: "--partition is required (0 or more)"}
	}
	if *from < 0 {
		return &usageError{msg: "--from-offset is required (0 or more)"}
	}
	if *reexecute && *reason == "" {
		return &usageError{msg: "--reexecute applies records a second time; say why with --reason"}
	}
	pool, err := connectPostgres(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	js, closeNATS, err := connectJetStream(*natsURL, "kfn replay")
	if err != nil {
		return err
	}
	defer closeNATS()
	res, err := operator.Replay(ctx, pool, js, operator.ReplayRequest{
		Function: *function, Topic: *topic, Partition: int32(*partition), From: *from,
		Reexecute: *reexecute, Reason: *reason, Actor: actor("replay"), LeaseBucket: *bucket,
	})
	if err != nil {
		return err
	}
	mode := "idempotent: records already handled will be skipped"
	if *reexecute {
		mode = fmt.Sprintf("re-execution: %d inbox rows released, records from %d will be applied again", res.InboxReleased, *from)
	}
	fmt.Fprintf(stdout, "%s/%s/%d: cursor %d -> %d (%s); a worker resumes there within a few seconds\n",
		*function, *topic, *partition, res.Previous.NextOffset, res.Now.NextOffset, mode)
	return nil
}

// actor names who ran a kfn command, for the audit log.
func actor(command string) string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return fmt.Sprintf("kfn-%s:%s@%s", command, name, host)
}

// connectJetStream connects to NATS and returns its JetStream API and a
// function that closes the connection.
func connectJetStream(url, name string) (jetstream.JetStream, func(), error) {
	nc, js, err := connect.NATS(url, name)
	if err != nil {
		return nil, nil, err
	}
	return js, nc.Close, nil
}
