package outbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

const relayProcPkg = "github.com/kfn-dev/kfn/outbox/internal/relayproc"

// relayProc is one running relayproc process.
type relayProc struct {
	t testing.TB
	*kfntest.Process
}

// startRelayProc starts a relay process for the fixture; extra holds
// KEY=value settings such as KFN_KILL_AFTER_ACK=100.
func (f *relayFixture) startRelayProc(natsURL string, extra ...string) *relayProc {
	f.t.Helper()
	cmd := exec.Command(kfntest.BuildBinary(f.t, relayProcPkg))
	cmd.Env = append(os.Environ(),
		"KFN_DATABASE_URL="+f.db.URL,
		"KFN_NATS_URL="+natsURL,
		"KFN_STREAM="+f.stream,
		"KFN_SUBJECTS="+f.subject+".>",
	)
	cmd.Env = append(cmd.Env, extra...)
	return &relayProc{t: f.t, Process: kfntest.StartProcess(f.t, cmd)}
}

// waitKilled waits for the process to die of SIGKILL at its fault point.
func (p *relayProc) waitKilled(timeout time.Duration) {
	p.t.Helper()
	select {
	case <-p.Exited():
	case <-time.After(timeout):
		p.t.Fatalf("relayproc did not reach its fault point within %v; output:\n%s", timeout, p.LogTail(40))
	}
	var exitErr *exec.ExitError
	ws, ok := syscall.WaitStatus(0), false
	if errors.As(p.ExitErr(), &exitErr) {
		ws, ok = exitErr.Sys().(syscall.WaitStatus)
	}
	if !ok || ws.Signal() != syscall.SIGKILL || !strings.Contains(p.LogTail(40), "fault point reached") {
		p.t.Fatalf("relayproc exited with %v, want SIGKILL at its fault point; output:\n%s", p.ExitErr(), p.LogTail(40))
	}
}

// stop ends the process with SIGTERM and checks it exited cleanly.
func (p *relayProc) stop() {
	p.t.Helper()
	p.Stop()
	if err := p.ExitErr(); err != nil {
		p.t.Fatalf("relayproc exited with %v on SIGTERM; output:\n%s", err, p.LogTail(40))
	}
}

// Killed after the stream acked every event of a batch but before the relay
// deleted any row: the restarted relay publishes them all again, and the
// stream's Nats-Msg-Id window drops every one of them.
func TestRelayCrashAfterPublishBeforeDelete(t *testing.T) {
	t.Parallel()
	natsURL := kfntest.NATSURL(t)
	f := newRelayFixture(t, natsURL)
	rows := f.newRows(sameShardKeys(10), 10) // one shard, one batch
	f.insert(rows)

	f.startRelayProc(natsURL, fmt.Sprintf("KFN_KILL_AFTER_ACK=%d", len(rows))).waitKilled(30 * time.Second)
	if n, m := f.outboxCount(), f.streamMsgs(); n != len(rows) || m != len(rows) {
		t.Fatalf("after the kill: %d rows in the outbox and %d messages in the stream, want %d and %d (all published, none deleted)", n, m, len(rows), len(rows))
	}

	p := f.startRelayProc(natsURL)
	f.waitDelivered(len(rows), 30*time.Second)
	p.stop()
	f.requireExactlyOnceInOrder(rows)
}

// Killed just before a publish: the events not yet sent stay in the outbox
// and go out after the restart, after the ones already sent, once each.
func TestRelayCrashBeforePublish(t *testing.T) {
	t.Parallel()
	natsURL := kfntest.NATSURL(t)
	for _, killAt := range []int{1, 41} {
		t.Run(fmt.Sprintf("publish %d", killAt), func(t *testing.T) {
			f := newRelayFixture(t, natsURL)
			rows := f.newRows(sameShardKeys(10), 10)
			f.insert(rows)

			f.startRelayProc(natsURL, fmt.Sprintf("KFN_KILL_BEFORE_PUBLISH=%d", killAt)).waitKilled(30 * time.Second)
			if n, m := f.outboxCount(), f.streamMsgs(); n != len(rows) || m > killAt-1 {
				t.Fatalf("after the kill: %d rows in the outbox and %d messages in the stream, want %d and at most %d", n, m, len(rows), killAt-1)
			}

			p := f.startRelayProc(natsURL)
			f.waitDelivered(len(rows), 30*time.Second)
			p.stop()
			f.requireExactlyOnceInOrder(rows)
		})
	}
}

// Killed in the middle of batches on every shard, twice, while rows keep
// being committed: nothing lost, nothing stored twice, key order kept.
func TestRelayCrashMidBatch(t *testing.T) {
	t.Parallel()
	natsURL := kfntest.NATSURL(t)
	f := newRelayFixture(t, natsURL)
	keys := keyNames("k", 120)
	var committed []Row
	for range 10 {
		rows := f.newRows(keys, 2)
		f.insert(rows)
		committed = append(committed, rows...)
	}

	// Keep committing while the relays crash.
	ctx, cancel := context.WithCancel(context.Background())
	var producer sync.WaitGroup
	var mu sync.Mutex
	producer.Add(1)
	go func() {
		defer producer.Done()
		for i := 0; i < 30 && ctx.Err() == nil; i++ {
			rows := f.newRows(keys, 1)
			f.insert(rows)
			mu.Lock()
			committed = append(committed, rows...)
			mu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()

	f.startRelayProc(natsURL, "KFN_BATCH=16", "KFN_KILL_AFTER_ACK=700").waitKilled(30 * time.Second)
	f.startRelayProc(natsURL, "KFN_BATCH=16", "KFN_KILL_AFTER_ACK=900").waitKilled(30 * time.Second)
	producer.Wait()
	cancel()
	if n := f.outboxCount(); n == 0 {
		t.Fatal("the crashes came too late to test anything: the outbox is already empty")
	}

	p := f.startRelayProc(natsURL, "KFN_BATCH=16")
	mu.Lock()
	all := append([]Row{}, committed...)
	mu.Unlock()
	f.waitDelivered(len(all), 60*time.Second)
	p.stop()
	f.requireExactlyOnceInOrder(all)
}
