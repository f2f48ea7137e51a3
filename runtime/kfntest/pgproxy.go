package kfntest

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// PGProxy is a TCP proxy in front of Postgres for fault tests. It forwards
// bytes both ways, and on request it misbehaves in two ways:
//
//   - CutCommits(n): the next n COMMITs are forwarded to the server, which
//     runs them, and then the connection is cut instead of passing the
//     server's "committed" reply to the client: the commit lands, but the
//     client sees an error and cannot know.
//   - Freeze/Thaw: a frozen proxy forwards nothing, in either direction, and
//     connects no new client to the server, but it closes nothing either:
//     every socket stays open, as on a network path that silently stalls. On
//     Thaw it delivers what it held back and carries on.
//   - Down/Up: a proxy that is down closes every connection and refuses new
//     ones (nothing listens on its port), as a stopped Postgres server does;
//     Up listens on the same port again.
type PGProxy struct {
	ln     net.Listener // nil while down
	addr   string
	target string

	armed   atomic.Int32 // how many more commits to cut off
	dropped atomic.Int32 // commits cut off so far

	mu     sync.Mutex
	thawed chan struct{} // nil unless frozen; closed by Thaw
	conns  map[net.Conn]bool
	wg     sync.WaitGroup
}

// commitComplete is the server's reply to a COMMIT that committed, however
// the client sent it (a simple query, or pipelined in the extended
// protocol behind the outbox rows): CommandComplete ('C', length 11) with
// the tag "COMMIT". When the proxy sees it, the server has committed.
var commitComplete = []byte("C\x00\x00\x00\x0bCOMMIT\x00")

// PostgresProxy starts a PGProxy on a free loopback port in front of
// target (host:port) and closes it, and every socket it holds, when the
// test ends.
func PostgresProxy(t testing.TB, target string) *PGProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("kfntest: listen for a Postgres proxy: %v", err)
	}
	p := &PGProxy{ln: ln, addr: ln.Addr().String(), target: target, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept(ln)
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port, to put in a database URL.
func (p *PGProxy) Addr() string { return p.addr }

// Down closes every connection through the proxy and stops listening, so
// that a client's connects are refused until Up: Postgres stopped, as its
// clients see it.
func (p *PGProxy) Down() {
	p.mu.Lock()
	ln := p.ln
	p.ln = nil
	for c := range p.conns {
		c.Close()
	}
	p.conns = map[net.Conn]bool{}
	p.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
}

// Up listens on the proxy's port again after Down.
func (p *PGProxy) Up() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		return nil
	}
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		return err
	}
	p.ln = ln
	p.wg.Add(1)
	go p.accept(ln)
	return nil
}

// CutCommits arms the proxy to cut off the replies of the next n COMMITs.
func (p *PGProxy) CutCommits(n int) { p.armed.Store(int32(n)) }

// CommitsCut is how many COMMIT replies the proxy has cut off so far.
func (p *PGProxy) CommitsCut() int { return int(p.dropped.Load()) }

// Freeze stops all forwarding, keeping every socket open.
func (p *PGProxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thawed == nil {
		p.thawed = make(chan struct{})
	}
}

// Thaw resumes forwarding.
func (p *PGProxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thawed != nil {
		close(p.thawed)
		p.thawed = nil
	}
}

// pass blocks while the proxy is frozen.
func (p *PGProxy) pass() {
	p.mu.Lock()
	ch := p.thawed
	p.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

func (p *PGProxy) close() {
	p.Thaw()
	p.Down()
	p.wg.Wait()
}

// track registers c to be closed by Down (and close); while the proxy is
// down, it closes c at once.
func (p *PGProxy) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		c.Close()
		return
	}
	p.conns[c] = true
}

func (p *PGProxy) accept(ln net.Listener) {
	defer p.wg.Done()
	for {
		client, err := ln.Accept()
		if err != nil {
			return
		}
		p.track(client)
		p.wg.Add(1)
		go p.serve(client)
	}
}

func (p *PGProxy) serve(client net.Conn) {
	defer p.wg.Done()
	p.pass() // a frozen path connects nobody, and refuses nobody
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		client.Close()
		return
	}
	p.track(server)
	p.wg.Add(2)
	go func() { // server → client, watching for COMMIT replies
		defer p.wg.Done()
		defer client.Close()
		defer server.Close()
		buf := make([]byte, 64<<10)
		for {
			n, err := server.Read(buf)
			if n > 0 {
				p.pass()
				if bytes.Contains(buf[:n], commitComplete) && p.armed.Add(-1) >= 0 {
					p.dropped.Add(1)
					return // both sides close: the commit landed, its reply is lost
				}
				if _, werr := client.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	go func() { // client → server
		defer p.wg.Done()
		defer server.Close()
		defer client.Close()
		buf := make([]byte, 64<<10)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				p.pass()
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
