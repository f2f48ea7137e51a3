package runtime_test

import (
	"bytes"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/internal/effects"
)

// commitDropper is a TCP proxy in front of Postgres that, while armed,
// forwards a COMMIT to the server, lets the server run it, and then cuts the
// connection before the reply reaches the client: the commit lands, but the
// client sees an error and cannot know.
type commitDropper struct {
	ln      net.Listener
	target  string
	armed   atomic.Int32 // how many more commits to cut off
	dropped atomic.Int32
	wg      sync.WaitGroup
}

// commitMessage is the protocol message pgx sends for Tx.Commit: a simple
// Query ('Q', length 11) with the text "commit".
var commitMessage = []byte("Q\x00\x00\x00\x0bcommit\x00")

func newCommitDropper(t *testing.T, target string) *commitDropper {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &commitDropper{ln: ln, target: target}
	d.wg.Add(1)
	go d.accept()
	t.Cleanup(func() {
		ln.Close()
		d.wg.Wait()
	})
	return d
}

func (d *commitDropper) accept() {
	defer d.wg.Done()
	for {
		client, err := d.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", d.target)
		if err != nil {
			client.Close()
			continue
		}
		var cut atomic.Bool // set before a COMMIT goes out: its reply must not come back
		d.wg.Add(2)
		go func() { // server → client
			defer d.wg.Done()
			defer client.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := server.Read(buf)
				if cut.Load() {
					return
				}
				if n > 0 {
					if _, werr := client.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
		go func() { // client → server, watching for COMMIT
			defer d.wg.Done()
			defer server.Close()
			defer client.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := client.Read(buf)
				if n > 0 {
					isCommit := bytes.Contains(buf[:n], commitMessage)
					if isCommit && d.armed.Add(-1) >= 0 {
						cut.Store(true)
						d.dropped.Add(1)
						if _, werr := server.Write(buf[:n]); werr != nil {
							return
						}
						time.Sleep(100 * time.Millisecond) // the server commits
						return                             // both sides close: the reply is lost
					}
					if _, werr := server.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

// TestCommitWhoseReplyIsLostIsNeitherRepeatedNorMistakenForATakeover makes
// commits land while the worker sees them fail. Retrying would apply the
// batch twice without the fence; with it, the worker must see that the
// cursor moved under its own token, resume from there, and keep its
// partitions.
func TestCommitWhoseReplyIsLostIsNeitherRepeatedNorMistakenForATakeover(t *testing.T) {
	b := setup(t, 1)
	u, err := url.Parse(b.pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newCommitDropper(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	b.cfg.DatabaseURL = u.String()
	b.cfg.NoRelay = true // only the record path talks to Postgres through the proxy

	fn := effects.Function(b.fn, b.topic)
	w, stop := b.run(t, fn)
	var produced []effects.Produced
	for round := 0; round < 3; round++ {
		proxy.armed.Store(1)
		produced = append(produced, b.produceN(t, 1, 10)...)
		b.waitCaughtUp(t, b.fn)
	}
	stop()
	if proxy.dropped.Load() < 3 {
		t.Fatalf("the proxy cut off %d commits, want 3: the scenario did not happen", proxy.dropped.Load())
	}
	if rep := b.check(t, b.fn, produced); rep.Applied != 30 {
		t.Errorf("applied %d, want 30", rep.Applied)
	}
	if n := w.Stats().Fenced.Load(); n != 0 {
		t.Errorf("the worker dropped its partition %d times as fenced after its own commit landed", n)
	}
}
