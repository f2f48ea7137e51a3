package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// orderRows makes the rows the orders function's exactly-once path writes
// for benchmark records, for the limits of kfn bench: the order, the inbox
// row (under its partition's lane) and the orders.accepted event.
type orderRows struct {
	topic      string
	partitions int
	mu         sync.Mutex
	lanes      map[string][]int32 // by consumer, the lane of each partition
}

func newOrderRows(topic string, partitions int) *orderRows {
	return &orderRows{topic: topic, partitions: partitions, lanes: map[string][]int32{}}
}

// batch is the rows of records [first, first+n).
type batch struct {
	business, inbox, outbox [][]any
	events                  [][]byte // each event as the WAL limit emits it
}

func (o *orderRows) batch(ctx context.Context, pool *pgxpool.Pool, consumer string, first, n int64) (batch, error) {
	lanes, err := o.lanesOf(ctx, pool, consumer)
	if err != nil {
		return batch{}, err
	}
	b := batch{business: make([][]any, n), inbox: make([][]any, n), outbox: make([][]any, n), events: make([][]byte, n)}
	now := time.Now()
	for j := range n {
		i := first + j
		key, value := validOrder(int(i))
		ord, err := runtime.DecodeJSON[orders.Order](value)
		if err != nil {
			return batch{}, err
		}
		data, _ := json.Marshal(ord)
		partition := int32(i % int64(o.partitions))
		b.business[j] = []any{ord.ID, ord.Customer, ord.AmountCents, ord.Currency}
		b.inbox[j] = []any{lanes[partition], i, int64(1)}
		row := outbox.NewRow(outbox.Origin{Consumer: consumer, Topic: o.topic, Partition: partition, Offset: i, SourceID: outbox.KafkaSourceID(o.topic, partition, i)},
			0, key, outbox.Event{Subject: orders.AcceptedSubject, Key: ord.ID, Data: data})
		b.outbox[j] = []any{row.EventID, row.Event.Subject, row.Event.Type, []byte(row.Event.Key), row.Shard, row.Event.Data, map[string]string{},
			consumer, o.topic, partition, i, now}
		// What an outbox row holds, as one message.
		b.events[j], _ = json.Marshal(map[string]any{"id": row.EventID, "subject": row.Event.Subject, "type": row.Event.Type,
			"key": row.Event.Key, "shard": row.Shard, "data": json.RawMessage(row.Event.Data), "source": consumer, "partition": partition, "offset": i})
	}
	return b, nil
}

// lanesOf returns the lane ids of the consumer's partitions, adding them
// the first time (the exactly-once path's claims add them).
func (o *orderRows) lanesOf(ctx context.Context, pool *pgxpool.Pool, consumer string) ([]int32, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if lanes, ok := o.lanes[consumer]; ok {
		return lanes, nil
	}
	lanes := make([]int32, o.partitions)
	for p := range int32(o.partitions) {
		part := inbox.Partition{Consumer: consumer, Topic: o.topic, Partition: p}
		if err := inbox.AddLane(ctx, pool, part); err != nil {
			return nil, err
		}
		if err := pool.QueryRow(ctx, `SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3`, consumer, o.topic, p).Scan(&lanes[p]); err != nil {
			return nil, fmt.Errorf("the lane of %s: %w", part, err)
		}
	}
	o.lanes[consumer] = lanes
	return lanes, nil
}

// copyOrders is the copy limit's writer: the order, the inbox row and the
// outbox row of each record, with COPY.
func (o *orderRows) copyOrders(ctx context.Context, pool *pgxpool.Pool, consumer string, first, n int64) (func(context.Context, pgx.Tx) error, error) {
	b, err := o.batch(ctx, pool, consumer, first, n)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, tx pgx.Tx) error { return copyRows(ctx, tx, b, true) }, nil
}

// emitOrders is the WAL limit's writer: the order and the inbox row with
// COPY, and the event emitted to the WAL in the transaction
// (pg_logical_emit_message(true, …)) rather than written to the outbox.
func (o *orderRows) emitOrders(ctx context.Context, pool *pgxpool.Pool, consumer string, first, n int64) (func(context.Context, pgx.Tx) error, error) {
	b, err := o.batch(ctx, pool, consumer, first, n)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, tx pgx.Tx) error {
		if err := copyRows(ctx, tx, b, false); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT count(pg_logical_emit_message(true, 'kfn', e)) FROM unnest($1::bytea[]) AS e`, b.events); err != nil {
			return fmt.Errorf("emit the events to the WAL: %w", err)
		}
		return nil
	}, nil
}

// copyInto is one COPY of a batch.
type copyInto struct {
	table   pgx.Identifier
	columns []string
	rows    [][]any
}

// copyRows copies a batch's orders and inbox rows, and with outboxRows its
// outbox rows.
func copyRows(ctx context.Context, tx pgx.Tx, b batch, outboxRows bool) error {
	copies := []copyInto{
		{pgx.Identifier{"orders"}, []string{"order_id", "customer", "amount_cents", "currency"}, b.business},
		{pgx.Identifier{"kfn", "inbox"}, []string{"lane", "offset", "epoch"}, b.inbox},
	}
	if outboxRows {
		copies = append(copies, copyInto{pgx.Identifier{"kfn", "outbox"}, []string{"event_id", "subject", "event_type", "event_key", "shard", "data", "headers",
			"source", "source_topic", "source_partition", "source_offset", "created_at"}, b.outbox})
	}
	for _, c := range copies {
		if _, err := tx.CopyFrom(ctx, c.table, c.columns, pgx.CopyFromRows(c.rows)); err != nil {
			return fmt.Errorf("copy into %s: %w", c.table.Sanitize(), err)
		}
	}
	return nil
}
