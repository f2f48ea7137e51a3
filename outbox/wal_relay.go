package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// walInbox is the ack inbox of the WAL slot reader, after the shards'.
const walInbox = Shards

// walApplicationName is the application_name of the slot reader's
// replication connection: a new reader terminates only walsenders with it.
const walApplicationName = "kfn-wal-relay"

// SlotLease decides when this process reads the WAL outbox's slot: Run
// calls work while this process holds the slot's lease, with the lease's
// fencing token, and cancels its ctx when the lease is lost; it returns
// when ctx ends. kfn's workers take it with a NATS lease (one item in the
// installation's WAL relay group).
type SlotLease interface {
	Run(ctx context.Context, work func(ctx context.Context, token uint64)) error
}

// errFenced is a slot reader whose token is older than the slot's fence:
// another reader took the slot over.
var errFenced = errors.New("another relay holds the WAL outbox's slot with a newer lease token")

// runSlot reads the WAL outbox's slot whenever this process may: while
// it holds the slot's lease (SlotLease), or all the time without one.
func (r *Relay) runSlot(ctx context.Context) {
	if r.cfg.SlotLease == nil {
		r.readSlotWhileHeld(ctx, 0)
		return
	}
	if err := r.cfg.SlotLease.Run(ctx, r.readSlotWhileHeld); err != nil && ctx.Err() == nil {
		r.log.Error("WAL outbox slot lease stopped", "err", err)
	}
}

// readSlotWhileHeld reads the slot until ctx ends, starting a new
// replication session (fenced with token) after each failure, with backoff.
func (r *Relay) readSlotWhileHeld(ctx context.Context, token uint64) {
	r.counters.slotHeld.Store(true)
	defer r.counters.slotHeld.Store(false)
	r.log.Info("reading the WAL outbox's slot", "token", token)
	retry := r.newBackoff()
	for ctx.Err() == nil {
		started := time.Now()
		err := r.readSlot(ctx, token)
		if ctx.Err() != nil {
			break
		}
		if time.Since(started) > time.Minute {
			retry.Reset()
		}
		delay := retry.NextBackOff()
		switch {
		case errors.Is(err, ErrSlotLost):
			delay = r.cfg.RetryMax
			r.log.Error("the WAL outbox's replication slot is gone: events written and not relayed before it went are lost, and workers in wal mode refuse to commit until `kfn migrate --outbox wal` creates it again (see \"Slot loss\" in docs/production/wal-outbox.md)",
				"err", err, "retry_in", delay)
		case errors.Is(err, errFenced):
			r.log.Warn("WAL outbox slot fenced by a newer reader; waiting", "err", err, "retry_in", delay)
		case errors.Is(err, ErrWALRetired), errors.Is(err, ErrWALNotSetUp):
			delay = r.cfg.RetryMax // retired and dropped (or never set up): no slot to read, and nothing lost
			r.log.Debug("no WAL outbox slot to read", "err", err, "retry_in", delay)
		default:
			r.log.Warn("WAL outbox slot reading stopped; starting again", "err", err, "retry_in", delay)
		}
		sleepCtx(ctx, delay)
	}
	r.log.Info("stopped reading the WAL outbox's slot", "token", token)
}

// replicationConfig is the pool's connection settings for a logical
// replication connection.
func (r *Relay) replicationConfig() *pgconn.Config {
	cfg := r.cfg.Pool.Config().ConnConfig.Config.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = walApplicationName
	return cfg
}

// readSlot is one replication session: connect, raise the fence (ending
// the walsender of any earlier reader), start replication from the slot's
// confirmed position, and relay until ctx ends or something fails.
func (r *Relay) readSlot(ctx context.Context, token uint64) error {
	conn, slot, err := r.openSlot(ctx, token)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx)) //nolint:errcheck // a broken connection is closed anyway
	acks := r.takeAckRouter(ctx)
	if acks == nil {
		return ctx.Err()
	}
	defer r.releaseAckRouter()
	s := newWALSession(r, conn, slot, token, acks)
	return s.run(ctx)
}

// errSlotBusy is a slot another walsender still holds: one just
// terminated lets go of it within moments.
var errSlotBusy = errors.New("the slot is still held by another walsender")

// openSlot connects, fences the slot with token and starts replication.
// While a terminated walsender still holds the slot, it starts over on a
// new connection (a failed START_REPLICATION leaves the old one unusable)
// for up to 10s.
func (r *Relay) openSlot(ctx context.Context, token uint64) (*pgconn.PgConn, string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		connectCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		conn, err := pgconn.ConnectConfig(connectCtx, r.replicationConfig())
		cancel()
		if err != nil {
			return nil, "", fmt.Errorf("open the replication connection: %w", err)
		}
		slot, publication, err := r.fenceSlot(ctx, conn, token)
		if err == nil {
			err = r.startReplication(ctx, conn, slot, publication)
		}
		if err == nil {
			return conn, slot, nil
		}
		conn.Close(context.WithoutCancel(ctx)) //nolint:errcheck // it failed already
		if !errors.Is(err, errSlotBusy) || time.Now().After(deadline) {
			return nil, "", err
		}
		if !sleepCtx(ctx, 50*time.Millisecond) {
			return nil, "", ctx.Err()
		}
	}
}

// fenceSlot raises the slot's fence to token on the replication
// connection's own session and terminates the walsender of the reader it
// replaces (recorded with the fence) and any walsender still on the slot,
// so that a reader that was stopped (SIGSTOP, a long pause) and wakes
// after a takeover finds its connection gone: it cannot confirm anything
// again, and it must pass this fence to read again, which its older token
// does not. Token 0 (no lease) takes the slot without raising the fence.
func (r *Relay) fenceSlot(ctx context.Context, conn *pgconn.PgConn, token uint64) (slot, publication string, err error) {
	tok := strconv.FormatUint(token, 10)
	cond := "w.fence_token <= " + tok
	set := "fence_token = " + tok + ","
	if token == 0 {
		cond, set = "true", ""
	}
	res, err := simpleQuery(ctx, conn, `
WITH prev AS (SELECT reader_pid FROM kfn.wal_outbox FOR UPDATE)
UPDATE kfn.wal_outbox w SET `+set+` reader = `+quoteLiteral(r.cfg.WorkerID)+`, reader_pid = pg_backend_pid(), fenced_at = now()
  FROM prev WHERE `+cond+`
RETURNING w.slot_name, w.publication, coalesce(prev.reader_pid, 0)`)
	if err != nil {
		return "", "", fmt.Errorf("fence the WAL outbox's slot: %w", err)
	}
	if len(res) == 0 {
		state, err := simpleQuery(ctx, conn, `SELECT fence_token FROM kfn.wal_outbox`)
		switch {
		case err != nil:
			return "", "", fmt.Errorf("read the WAL outbox's fence: %w", err)
		case len(state) == 0:
			return "", "", ErrWALNotSetUp
		}
		return "", "", fmt.Errorf("%w (the slot's fence is %s, this relay's token %d)", errFenced, state[0][0], token)
	}
	slot, publication, prevPID := res[0][0], res[0][1], res[0][2]
	if !slotNamePattern.MatchString(slot) {
		return "", "", fmt.Errorf("kfn.wal_outbox names slot %q, which is not a slot name", slot)
	}
	if _, err := strconv.Atoi(prevPID); err != nil {
		return "", "", fmt.Errorf("fence the WAL outbox's slot: reader pid %q", prevPID)
	}
	// Terminate the earlier reader's walsender, whether or not it is on
	// the slot yet, and whoever is on the slot.
	terminated, err := simpleQuery(ctx, conn, `
SELECT a.pid, pg_terminate_backend(a.pid)
  FROM pg_stat_activity a
 WHERE a.pid <> pg_backend_pid() AND a.backend_type = 'walsender' AND a.application_name = '`+walApplicationName+`'
   AND (a.pid = `+prevPID+` OR a.pid IN (SELECT active_pid FROM pg_replication_slots WHERE slot_name = '`+slot+`'))`)
	if err != nil {
		return "", "", fmt.Errorf("end the WAL outbox slot's earlier reader: %w", err)
	}
	for _, row := range terminated {
		r.log.Warn("ended the walsender of the WAL outbox slot's earlier reader", "pid", row[0], "token", token)
	}
	return slot, publication, nil
}

// startReplication checks that the slot exists and is usable, and starts
// replication from its confirmed position; errSlotBusy while another
// walsender holds it.
func (r *Relay) startReplication(ctx context.Context, conn *pgconn.PgConn, slot, publication string) error {
	state, err := simpleQuery(ctx, conn, `SELECT coalesce(wal_status, ''), coalesce(active_pid, 0), coalesce(confirmed_flush_lsn::text, '') FROM pg_replication_slots WHERE slot_name = '`+slot+`' AND database = current_database()`)
	if err != nil {
		return fmt.Errorf("read the WAL outbox's slot: %w", err)
	}
	if len(state) == 0 && retiredSlotGone(ctx, conn) {
		return fmt.Errorf("%w: its slot %s is dropped", ErrWALRetired, slot)
	}
	if len(state) == 0 || state[0][0] == "lost" {
		// Recorded before the flag goes up, so that whoever sees the flag
		// finds lost_at set too.
		simpleQuery(ctx, conn, `UPDATE kfn.wal_outbox SET lost_at = coalesce(lost_at, now())`) //nolint:errcheck // the report is best effort; the error below is the news
		r.counters.slotLost.Store(true)
		what := "does not exist"
		if len(state) > 0 {
			what = "lost the WAL it needed (max_slot_wal_keep_size)"
		}
		return fmt.Errorf("%w: slot %s %s", ErrSlotLost, slot, what)
	}
	r.counters.slotLost.Store(false)
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{PluginArgs: []string{
		"proto_version '1'", "publication_names '" + publication + "'", "messages 'true'",
	}})
	if err == nil {
		r.log.Info("WAL outbox replication started", "slot", slot, "confirmed", state[0][2])
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use
		return fmt.Errorf("start replication on slot %s: %w: %w", slot, errSlotBusy, err)
	}
	return fmt.Errorf("start replication on slot %s: %w", slot, err)
}

// simpleQuery runs sql (no parameters: a replication connection speaks
// the simple protocol only) and returns its last result's rows as text.
func simpleQuery(ctx context.Context, conn *pgconn.PgConn, sql string) ([][]string, error) {
	results, err := conn.Exec(ctx, sql).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(results) == 0 {
		return nil, nil
	}
	last := results[len(results)-1]
	if last.Err != nil {
		return nil, last.Err
	}
	out := make([][]string, len(last.Rows))
	for i, row := range last.Rows {
		out[i] = make([]string, len(row))
		for j, v := range row {
			out[i][j] = string(v)
		}
	}
	return out, nil
}

// quoteLiteral quotes s as a SQL string literal (standard_conforming_strings on).
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(strings.ReplaceAll(s, "\x00", ""), "'", "''") + "'"
}

// walItem is what the replication reader hands the session's loop: an
// event, the end of a transaction (commit), or the server's WAL end from
// a keepalive.
type walItem struct {
	kind walItemKind
	row  relayRow
	lsn  pglogrepl.LSN
}

type walItemKind uint8

const (
	walEvent walItemKind = iota
	walCommit
	walKeepalive
)

// walTxn is a transaction read from the slot with events: how many of
// them the stream has not acked, and where it ends. The slot may be
// confirmed past it once that count is 0 and every earlier one's is.
type walTxn struct {
	end     pglogrepl.LSN
	unacked int
	closed  bool
}

// walPending is an event read from the slot, not yet acked.
type walPending struct {
	row      relayRow
	txn      *walTxn
	next     *walPending // the next event of its key, in commit order
	attempts int
	seq      uint64 // reply sequence of its publish in flight; 0 if none
	deadline time.Time
	retryAt  time.Time // when a failed publish is sent again
	parked   bool      // the stream rejected it MaxAttempts times: it waits ParkFor
	span     trace.Span
}

// walQueue is the events of one key read and not yet acked, oldest
// first, linked by walPending.next.
type walQueue struct {
	head, tail *walPending
}

// walSession is one replication session's state. The reader goroutine
// owns the connection (it receives, and sends the status updates with
// the position the loop publishes in confirmed); the loop publishes,
// takes acks, and works out that position.
type walSession struct {
	r     *Relay
	conn  *pgconn.PgConn
	slot  string
	token uint64
	log   *slog.Logger
	acks  *ackRouter
	inbox *ackInbox
	items chan walItem
	// confirmed is the position the slot may be confirmed up to: the end
	// of the last transaction whose events, and every earlier one's, the
	// stream has acked.
	confirmed atomic.Uint64

	// The loop's state. keys holds, per key, its events in commit order:
	// the first is in flight or waiting to be sent again, the others wait
	// behind it (at most one unacked publish per key).
	keys    map[string]walQueue
	flights map[uint64]*walPending
	// sent holds the reply sequences of the publishes in flight in the
	// order they were sent, which is their deadlines' order (the front may
	// be settled already); retrying counts the keys whose first event
	// waits to be sent again.
	sent     []uint64
	retrying int
	txns     []*walTxn // in commit order, oldest first
	open     *walTxn   // the transaction being read; nil between transactions
	pending  int
	lastEnd  pglogrepl.LSN // the end of the last transaction or keepalive read
	// serverEnd is the server's WAL end as it last said (a keepalive, a
	// commit): what the slot holds lies between confirmed and it.
	serverEnd pglogrepl.LSN
	// oldestAt is when advance last looked for the oldest pending event.
	oldestAt time.Time
	message  messageBuf
	sources  map[string]string
	retry    *backoff.ExponentialBackOff // paces the sends of failed publishes
	// outage is set by a publish that failed for an outage and cleared by
	// the next ack, which sends again at once the events waiting out their
	// pause: each failure during an outage lengthens the pause of the next
	// (up to RetryMax), and without this the events that failed last waited
	// up to 1.5 × RetryMax after the stream was back (the chaos run's NATS
	// node kill: the ledger caught up 5-7 s after the stream's new leader).
	outage bool
}

func newWALSession(r *Relay, conn *pgconn.PgConn, slot string, token uint64, acks *ackRouter) *walSession {
	return &walSession{
		r: r, conn: conn, slot: slot, token: token, acks: acks, inbox: &acks.inbox[walInbox],
		log:     r.log.With("slot", slot, "token", token),
		items:   make(chan walItem, 256),
		keys:    map[string]walQueue{},
		flights: map[uint64]*walPending{},
		sources: map[string]string{},
		retry:   r.newBackoff(),
	}
}

// run relays until ctx ends or the connection fails; the events read and
// not acked by then are read again by the next session, from the
// confirmed position.
func (s *walSession) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	readErr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		readErr <- s.read(ctx)
	}()
	defer wg.Wait()
	defer s.endSpans()
	// A last report as the session ends, so that the position it
	// confirmed last is on record (slot loss is dated from it).
	defer s.report(context.WithoutCancel(ctx))
	report := time.NewTicker(s.r.cfg.StatusInterval)
	defer report.Stop()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		items := s.items
		if s.pending >= s.r.cfg.MaxPending {
			items = nil // full: the reader waits, and so does the walsender
		}
		timer.Reset(s.nextWake())
		select {
		case it := <-items:
			s.take(ctx, it)
			// Take what else is there before publishing.
			for more := true; more && s.pending < s.r.cfg.MaxPending; {
				select {
				case it := <-s.items:
					s.take(ctx, it)
				default:
					more = false
				}
			}
		case <-s.inbox.ready:
			s.takeAcks(ctx)
		case <-timer.C:
			s.expire(ctx)
		case <-report.C:
			s.report(ctx)
		case err := <-readErr:
			return err
		case <-ctx.Done():
			return nil
		}
		s.advance()
	}
}

// take adds an item read from the slot.
func (s *walSession) take(ctx context.Context, it walItem) {
	switch it.kind {
	case walEvent:
		if s.open == nil {
			s.open = &walTxn{}
			s.txns = append(s.txns, s.open)
		}
		p := &walPending{row: it.row, txn: s.open}
		s.open.unacked++
		s.pending++
		s.r.counters.walRead.Add(1)
		q := s.keys[p.row.Key]
		if q.head == nil {
			q.head = p
		} else {
			q.tail.next = p
		}
		q.tail = p
		s.keys[p.row.Key] = q
		if q.head == p {
			s.send(ctx, p)
		}
	case walCommit:
		if s.open != nil {
			s.open.end, s.open.closed = it.lsn, true
			s.open = nil
		}
		s.lastEnd = max(s.lastEnd, it.lsn)
		s.serverEnd = max(s.serverEnd, it.lsn)
	case walKeepalive:
		if s.open == nil {
			s.lastEnd = max(s.lastEnd, it.lsn)
		}
		s.serverEnd = max(s.serverEnd, it.lsn)
	}
}

// send publishes p, the first of its key, unless ctx has ended (the lease
// is lost: a reader that lost it sends nothing more).
func (s *walSession) send(ctx context.Context, p *walPending) {
	if ctx.Err() != nil {
		return
	}
	if !s.r.streamCovers(ctx, p.row.Subject) {
		s.failed(p, errors.New("the stream's subjects do not capture the event's subject"), false)
		return
	}
	msg, dropped := buildMessage(&p.row, s.r.cfg.Stream, s.source(p.row.Source), &s.message)
	if len(dropped) > 0 {
		s.log.Warn("dropped event headers NATS cannot carry", "event_id", p.row.EventID, "headers", dropped)
	}
	p.span = s.r.startPublish(&p.row, msg, attribute.String("kfn.slot", s.slot))
	seq, err := s.acks.send(walInbox, msg)
	if err != nil {
		endPublish(p.span, false, err)
		s.failed(p, err, isOutage(err))
		return
	}
	if !p.retryAt.IsZero() {
		s.retrying--
	}
	p.seq, p.deadline, p.retryAt = seq, time.Now().Add(s.r.cfg.AckTimeout), time.Time{}
	s.flights[seq] = p
	s.sent = append(s.sent, seq)
}

// failed schedules p's publish again after a pause. An event the stream
// keeps rejecting is not skipped (it would be lost): it holds its key,
// and the slot's position, until it goes through, and says so loudly.
func (s *walSession) failed(p *walPending, err error, outage bool) {
	s.r.counters.failures.Add(1)
	p.seq = 0
	p.attempts++
	delay := s.retry.NextBackOff()
	s.outage = s.outage || outage
	p.parked = !outage && p.attempts >= s.r.cfg.MaxAttempts
	if p.parked {
		delay = s.r.cfg.ParkFor
		if p.attempts == s.r.cfg.MaxAttempts {
			s.r.counters.parked.Add(1)
		}
		s.log.Error("an event of the WAL outbox cannot be published: its key, and the slot's position, wait until it can (the slot holds the WAL meanwhile)",
			"event_id", p.row.EventID, "subject", p.row.Subject, "key", p.row.Key, "attempts", p.attempts, "err", err, "retry_in", delay)
	} else {
		s.log.Warn("WAL outbox publish failed; sending it again", "event_id", p.row.EventID, "err", err, "retry_in", delay)
	}
	if p.retryAt.IsZero() {
		s.retrying++
	}
	p.retryAt = time.Now().Add(delay)
}

// takeAcks settles the publishes whose acks came in.
func (s *walSession) takeAcks(ctx context.Context) {
	got := s.inbox.take(nil)
	now := time.Now()
	for _, a := range got {
		if a.lost {
			for seq, p := range s.flights {
				if seq <= a.seq {
					delete(s.flights, seq)
					endPublish(p.span, false, a.err)
					s.failed(p, a.err, true)
				}
			}
			continue
		}
		p, ok := s.flights[a.seq]
		if !ok {
			continue // timed out and sent again, or an earlier session's
		}
		delete(s.flights, a.seq)
		endPublish(p.span, a.duplicate, a.err)
		if a.err != nil {
			s.failed(p, a.err, isOutage(a.err))
			continue
		}
		s.acked(ctx, p, a.duplicate, now)
	}
}

// acked settles p and sends the next event of its key.
func (s *walSession) acked(ctx context.Context, p *walPending, duplicate bool, now time.Time) {
	s.retry.Reset()
	if s.outage {
		s.outage = false
		s.retryNow(now)
	}
	s.r.counters.acked(duplicate, p.row.CreatedAt, now)
	if s.r.cfg.AfterAck != nil {
		s.r.cfg.AfterAck(p.row.EventID, now)
	}
	p.txn.unacked--
	s.pending--
	next := p.next
	p.next = nil
	if next == nil {
		delete(s.keys, p.row.Key)
		return
	}
	s.keys[p.row.Key] = walQueue{head: next, tail: s.keys[p.row.Key].tail}
	s.send(ctx, next)
}

// retryNow makes the events waiting out an outage's pause due at now (the
// loop's next expire sends them); a parked event keeps its wait.
func (s *walSession) retryNow(now time.Time) {
	if s.retrying == 0 {
		return
	}
	for _, q := range s.keys {
		if p := q.head; p.seq == 0 && !p.retryAt.IsZero() && !p.parked && p.retryAt.After(now) {
			p.retryAt = now
		}
	}
}

// expire fails the publishes whose ack is overdue and sends again those
// whose pause is over.
func (s *walSession) expire(ctx context.Context) {
	now := time.Now()
	for seq, p := range s.flights {
		if !now.Before(p.deadline) {
			delete(s.flights, seq)
			endPublish(p.span, false, errAckTimeout)
			s.failed(p, errAckTimeout, true)
		}
	}
	if s.retrying == 0 {
		return
	}
	for _, q := range s.keys {
		if p := q.head; p.seq == 0 && !p.retryAt.IsZero() && !now.Before(p.retryAt) {
			s.send(ctx, p)
		}
	}
}

// nextWake is how long the loop may wait for news before a deadline or
// a retry is due.
func (s *walSession) nextWake() time.Duration {
	next := time.Now().Add(time.Hour)
	for len(s.sent) > 0 {
		if p, ok := s.flights[s.sent[0]]; ok {
			next = p.deadline
			break
		}
		s.sent = s.sent[1:]
	}
	if s.retrying > 0 {
		for _, q := range s.keys {
			if p := q.head; p.seq == 0 && !p.retryAt.IsZero() && p.retryAt.Before(next) {
				next = p.retryAt
			}
		}
	}
	return max(time.Until(next), time.Millisecond)
}

// advance moves the confirmable position past every leading transaction
// whose events are all acked; with none left, to the last end read.
func (s *walSession) advance() {
	i := 0
	for i < len(s.txns) && s.txns[i].closed && s.txns[i].unacked == 0 {
		s.confirmed.Store(uint64(max(pglogrepl.LSN(s.confirmed.Load()), s.txns[i].end)))
		i++
	}
	if i > 0 {
		clear(s.txns[:i])
		s.txns = s.txns[i:]
	}
	if len(s.txns) == 0 && s.open == nil {
		s.confirmed.Store(uint64(max(pglogrepl.LSN(s.confirmed.Load()), s.lastEnd)))
	}
	s.r.counters.walPending.Store(int64(s.pending))
	s.r.counters.walHeld.Store(int64(max(s.serverEnd, pglogrepl.LSN(s.confirmed.Load())) - pglogrepl.LSN(s.confirmed.Load())))
	s.findOldest()
}

// oldestEvery is how often findOldest looks through the keys for the
// oldest pending event while some are pending.
const oldestEvery = 100 * time.Millisecond

// findOldest records the emit time of the oldest pending event (the
// oldest first event of a key). It looks through every key, so it does
// so at most every oldestEvery, and at once when events become pending:
// looking after each turn of the loop cost a pass over up to MaxPending
// keys per handful of events (a tenth of the loop's CPU at full load, and
// more the more events are pending). In between, the time it reports may
// be that of an event acked since, at most oldestEvery ago.
func (s *walSession) findOldest() {
	if s.pending == 0 {
		s.r.counters.walOldest.Store(0)
		return
	}
	now := time.Now()
	if s.r.counters.walOldest.Load() != 0 && now.Sub(s.oldestAt) < oldestEvery {
		return
	}
	s.oldestAt = now
	var oldest time.Time
	for _, q := range s.keys {
		if c := q.head.row.CreatedAt; oldest.IsZero() || c.Before(oldest) {
			oldest = c
		}
	}
	if oldest.IsZero() {
		s.r.counters.walOldest.Store(0)
	} else {
		s.r.counters.walOldest.Store(oldest.UnixNano())
	}
}

// report records the session's position and backlog in kfn.wal_outbox for
// `kfn status`, if its token still holds the fence.
func (s *walSession) report(ctx context.Context) {
	oldest := s.r.counters.walOldest.Load()
	var oldestAt *time.Time
	if s.pending > 0 && oldest != 0 {
		t := time.Unix(0, oldest)
		oldestAt = &t
	}
	rctx, cancel := context.WithTimeout(ctx, s.r.cfg.StatusInterval)
	defer cancel()
	_, err := s.r.cfg.Pool.Exec(rctx, `
UPDATE kfn.wal_outbox SET confirmed_at = CASE WHEN confirmed_lsn IS DISTINCT FROM $1::pg_lsn THEN now() ELSE confirmed_at END,
       confirmed_lsn = $1::pg_lsn, pending_events = $2, oldest_pending = $3, reported_at = now()
 WHERE fence_token = $4 OR $4 = 0`, pglogrepl.LSN(s.confirmed.Load()).String(), s.pending, oldestAt, int64(s.token))
	if err != nil && ctx.Err() == nil {
		s.log.Debug("could not report the WAL outbox's position", "err", err)
	}
}

// endSpans ends the spans of the publishes still in flight as the session stops.
func (s *walSession) endSpans() {
	for _, p := range s.flights {
		endPublish(p.span, false, errStoppedBeforeAck)
	}
	s.r.counters.walPending.Store(0)
	s.r.counters.walOldest.Store(0)
}

// source returns the ce-source of events emitted by function fn.
func (s *walSession) source(fn string) string {
	src, ok := s.sources[fn]
	if !ok {
		if len(s.sources) > 1000 {
			clear(s.sources)
		}
		src = CloudEventsSourcePrefix + fn
		s.sources[strings.Clone(fn)] = src
	}
	return src
}

// read receives the slot's messages and hands the loop the events and
// transaction ends, and sends the status updates: every StatusInterval,
// when the server asks, while the loop is too busy to take more, and once
// more as the session stops (a relay stopped cleanly leaves nothing acked
// to publish again: after the stream's duplicate window, that would store
// duplicates).
func (s *walSession) read(ctx context.Context) error {
	nextStatus := time.Now()
	var sent pglogrepl.LSN
	send := func(ctx context.Context) error {
		pos := pglogrepl.LSN(s.confirmed.Load())
		err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos, WALFlushPosition: pos, WALApplyPosition: pos})
		if err != nil {
			return fmt.Errorf("confirm the slot's position %s: %w", pos, err)
		}
		if pos != sent {
			s.log.Debug("confirmed the WAL outbox's slot", "lsn", pos)
			sent = pos
		}
		nextStatus = time.Now().Add(s.r.cfg.StatusInterval)
		return nil
	}
	status := func() error { return send(ctx) }
	defer func() {
		if ctx.Err() != nil && !s.conn.IsClosed() {
			last, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			if err := send(last); err != nil {
				s.log.Debug("could not confirm the slot's position as the session stopped", "err", err)
			}
		}
	}()
	deliver := func(it walItem) error {
		select {
		case s.items <- it: // the common case: no timer to make
			return nil
		default:
		}
		for {
			if !time.Now().Before(nextStatus) {
				if err := status(); err != nil {
					return err
				}
			}
			t := time.NewTimer(time.Until(nextStatus))
			select {
			case s.items <- it:
				t.Stop()
				return nil
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			}
		}
	}
	// The wait for the next message ends at nextStatus by the connection's
	// read deadline, not by a context handed to ReceiveMessage: a context
	// costs pgconn a watch per call (a channel and an AfterFunc, made and
	// stopped), and the walsender sends a message per event (a microsecond
	// of each event's, a seventh of the relay's CPU). The session's end
	// moves the deadline to now, so that a read in progress ends at once.
	netConn := s.conn.Conn()
	stopWatch := context.AfterFunc(ctx, func() {
		netConn.SetReadDeadline(time.Now()) //nolint:errcheck // a closed connection ends the read anyway
	})
	defer stopWatch()
	var deadline time.Time
	for {
		if !time.Now().Before(nextStatus) {
			if err := status(); err != nil {
				return err
			}
		}
		if !deadline.Equal(nextStatus) {
			deadline = nextStatus
			if err := netConn.SetReadDeadline(deadline); err != nil {
				return fmt.Errorf("read the WAL outbox's slot: %w", err)
			}
			if ctx.Err() != nil {
				return nil // ended before the deadline above replaced the end's
			}
		}
		raw, err := s.conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("read the WAL outbox's slot: %w", err)
		}
		switch msg := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("read the WAL outbox's slot: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyData:
			if len(msg.Data) == 0 {
				continue
			}
			switch msg.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("read the WAL outbox's slot: %w", err)
				}
				if ka.ReplyRequested {
					nextStatus = time.Time{}
				}
				if err := deliver(walItem{kind: walKeepalive, lsn: ka.ServerWALEnd}); err != nil {
					return err
				}
			case pglogrepl.XLogDataByteID:
				xld, err := pglogrepl.ParseXLogData(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("read the WAL outbox's slot: %w", err)
				}
				it, ok, err := s.parse(xld.WALData)
				if err != nil {
					return err
				}
				if ok {
					if err := deliver(it); err != nil {
						return err
					}
				}
			}
		}
	}
}

// parse reads one pgoutput message: an event (a transactional message
// with WALPrefix) or a commit; others are not the relay's.
func (s *walSession) parse(data []byte) (walItem, bool, error) {
	msg, err := pglogrepl.Parse(data)
	if err != nil {
		return walItem{}, false, fmt.Errorf("decode a pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.LogicalDecodingMessage:
		if m.Prefix != WALPrefix || !m.Transactional {
			return walItem{}, false, nil
		}
		row, err := decodeWALEvent(m.Content)
		if err != nil {
			// Skipping it would lose the event: stop here, holding the slot.
			return walItem{}, false, fmt.Errorf("the WAL outbox's message at %s: %w", m.LSN, err)
		}
		return walItem{kind: walEvent, row: row, lsn: m.LSN}, true, nil
	case *pglogrepl.CommitMessage:
		return walItem{kind: walCommit, lsn: m.TransactionEndLSN}, true, nil
	}
	return walItem{}, false, nil
}

// WALStats is the slot reader's part of RelayStats.
type WALStats struct {
	// Reading reports whether this relay holds the slot (its lease) now.
	Reading bool
	// Read counts the events read from the slot (a republish after a
	// takeover reads an event again).
	Read uint64
	// Pending counts the events read from the slot and not yet acked.
	Pending int64
	// HeldBytes is the WAL the slot holds for this reader: from its
	// confirmable position to the server's WAL end as the server last
	// said (kfn status reads the same from pg_replication_slots).
	HeldBytes int64
	// OldestPending is the emit time of the oldest of them; zero if none.
	OldestPending time.Time
	// SlotLost reports that the last start found the slot gone.
	SlotLost bool
}
