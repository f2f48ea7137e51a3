package runtime

import "errors"

// Events collects the events a Handler emits for its record. The zero
// value collects them for Emitted only (a handler called directly).
type Events struct {
	emit    func(rec Record, ev Event) // set by the worker
	rec     Record
	emitted []Event
}

// NewEvents returns the Events a handler gets for rec, for calling a
// Handler directly (in a test); Emitted then lists what it emitted.
func NewEvents(rec Record) *Events { return &Events{rec: rec} }

// Emit adds an event to the outbox, in the record's transaction.
func (e *Events) Emit(ev Event) {
	e.emitted = append(e.emitted, ev)
	if e.emit != nil {
		e.emit(e.rec, ev)
	}
}

// Emitted lists the events emitted through e so far, in order.
func (e *Events) Emitted() []Event { return e.emitted }

// BatchEvents collects the events a BatchHandler emits and the records it
// rejects. The zero value collects them for Emitted and Rejected only (a
// batch handler called directly).
type BatchEvents struct {
	emit     func(rec Record, ev Event) // set by the worker
	emitted  []Event
	rejected []Rejection
}

// Rejection is a record a BatchHandler rejected with BatchEvents.Reject,
// with the reason: dead-lettered as permanent in the batch's transaction
// while the other records of the batch commit.
type Rejection struct {
	Record Record
	Err    error
}

// Reject dead-letters rec (reason permanent) instead of applying it,
// without failing the batch: the other records commit, and rec's dead
// letter with them, in the batch's transaction. Reject a record before
// writing anything for it (its writes would commit) and emit nothing for
// it (its events are dropped). It is for records no retry can fix, such as
// a value that does not decode. With KeyOrder ParkKey the batch stops at
// the first rejected record instead: the records before it commit, it is
// dead-lettered alone (parking its key), and the rest goes on.
func (e *BatchEvents) Reject(rec Record, err error) {
	if err == nil {
		err = errors.New("rejected")
	}
	if !IsPermanent(err) {
		err = Permanent(err)
	}
	e.rejected = append(e.rejected, Rejection{Record: rec, Err: err})
}

// Rejected lists the records rejected through e so far, in order.
func (e *BatchEvents) Rejected() []Rejection { return e.rejected }

// Emit adds an event emitted for source record rec to the outbox.
func (e *BatchEvents) Emit(rec Record, ev Event) {
	e.emitted = append(e.emitted, ev)
	if e.emit != nil {
		e.emit(rec, ev)
	}
}

// Emitted lists the events emitted through e so far, in order.
func (e *BatchEvents) Emitted() []Event { return e.emitted }
