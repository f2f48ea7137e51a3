package lease

import (
	"io"
	"maps"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// A member takes the items of a member that stopped all at once, not one
// after another: through a connection on which every request waits
// takeDelay, taking 6 items one by one costs at least 18 round trips
// (Status, Create, Status each), while taking them at once costs 3 (6 if
// the watch shows the departure before the releases, and the first try
// finds the leases still held).
func TestManagerTakesTheItemsOfAStoppedMemberAtOnce(t *testing.T) {
	t.Parallel()
	const takeDelay = 200 * time.Millisecond
	b := setup(t)
	tr := newTracker()
	defer tr.check(t)
	items := itemsOf(12)
	// Round trips of up to a few takeDelay fit in RenewEvery, as the
	// defaults' proportions (TTL 5 s, RenewEvery 1 s) would not.
	cfg := func(member string) Config {
		c := testManagerConfig(member)
		c.Bucket, c.TTL, c.SafetyMargin, c.RenewEvery = "slow_leases", 10*time.Second, 3*time.Second, 2*time.Second
		return c
	}
	slow := connect(t, delayProxy(t, strings.TrimPrefix(b.nats.URL, "nats://"), takeDelay))
	stopA := runMember(t, newManager(t, slow, cfg("A")), items, tr)
	defer stopA()
	stopB := runMember(t, newManager(t, connect(t, b.nats.URL), cfg("B")), items, tr)
	want := Assign([]string{"A", "B"}, names("orders/", 12))
	waitFor(t, livenessBound, "A and B to own their shares", func() bool { return maps.Equal(tr.owners(), want) })

	stopped := time.Now()
	stopB()
	waitFor(t, livenessBound, "A to take B's items", func() bool { return tr.ownsAll("A", 12) })
	took := time.Since(stopped)
	oneByOne := 18 * takeDelay
	t.Logf("A took B's 6 items %v after B was told to stop (round trips of at least %v; one by one they take at least %v)", took.Round(time.Millisecond), takeDelay, oneByOne)
	if took >= oneByOne {
		t.Errorf("A took B's items %v after B stopped: not less than 18 round trips (%v), as if it acquired them one after another", took, oneByOne)
	}
}

// delayProxy forwards connections to target and returns its URL. Each
// chunk a client sends is passed on delay after it arrived, in order, so
// that every request waits delay, however many are in flight.
func delayProxy(t *testing.T, target string, delay time.Duration) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			type chunk struct {
				data []byte
				at   time.Time
			}
			chunks := make(chan chunk, 1024)
			wg.Go(func() { _, _ = io.Copy(client, server); client.Close() })
			wg.Go(func() {
				defer close(chunks)
				for {
					buf := make([]byte, 64<<10)
					n, err := client.Read(buf)
					if n > 0 {
						chunks <- chunk{buf[:n], time.Now()}
					}
					if err != nil {
						return
					}
				}
			})
			wg.Go(func() {
				defer server.Close()
				for c := range chunks {
					time.Sleep(time.Until(c.at.Add(delay)))
					if _, err := server.Write(c.data); err != nil {
						return
					}
				}
			})
		}
	})
	return "nats://" + ln.Addr().String()
}
