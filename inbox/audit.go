package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// writeAudit appends one operator-visible action on a partition to
// kfn.audit_log inside tx: who did what, and the details (offsets, epoch,
// reason) as a JSON object.
func writeAudit(ctx context.Context, tx pgx.Tx, actor, action string, p Partition, details map[string]any) error {
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details) VALUES ($1, $2, $3, $4, $5, $6)`,
		actor, action, p.Consumer, p.Topic, p.Partition, details)
	if err != nil {
		return fmt.Errorf("audit %s of %s: %w", action, p, err)
	}
	return nil
}

// lockOwnedCursor reads and locks the partition's cursor inside tx, and
// checks that token is its epoch: only the holder of the partition's lease
// may move it.
func lockOwnedCursor(ctx context.Context, tx pgx.Tx, p Partition, token int64) (Cursor, error) {
	var c Cursor
	err := tx.QueryRow(ctx, `SELECT next_offset, high_water, generation, epoch, owner FROM kfn.cursors
 WHERE consumer = $1 AND topic = $2 AND partition = $3 FOR UPDATE`, p.Consumer, p.Topic, p.Partition).
		Scan(&c.NextOffset, &c.HighWater, &c.Generation, &c.Epoch, &c.Owner)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return Cursor{}, fmt.Errorf("partition %s has no cursor: nothing was ever processed there", p)
		}
		return Cursor{}, fmt.Errorf("read cursor of %s: %w", p, err)
	}
	if c.Epoch != token {
		return Cursor{}, &FencedError{Partition: p, Token: token, Epoch: c.Epoch}
	}
	return c, nil
}
