package runtime_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
)

// TestRecordsProducedWithKcatAreAppliedOnce produces records the way a user
// would, with kcat (a librdkafka client), and checks the function sees each
// exactly once with its key, headers and value intact: text, empty, null and
// binary values.
func TestRecordsProducedWithKcatAreAppliedOnce(t *testing.T) {
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		t.Fatal("kcat is not installed (Debian: apt-get install kcat); .ci/run installs it")
	}
	b := setup(t, 1)
	brokers := strings.Join(b.kafka.Brokers, ",")
	produce := func(stdin string, args ...string) {
		t.Helper()
		cmd := exec.Command(kcat, append([]string{"-b", brokers, "-P", "-t", b.topic, "-p", "0"}, args...)...)
		cmd.Stdin = strings.NewReader(stdin)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("kcat %v: %v\n%s", args, err, out)
		}
	}
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i)
	}
	binFile := filepath.Join(t.TempDir(), "binary.bin")
	if err := os.WriteFile(binFile, binary, 0o600); err != nil {
		t.Fatal(err)
	}
	produce("k1|hello\nk2|world\n", "-K", "|", "-H", "trace=abc", "-H", "src=kcat")
	produce("k3|\n", "-K", "|", "-Z") // -Z sends the empty value as NULL: a tombstone
	produce("k4|\n", "-K", "|")       // an empty value
	produce("", "-k", "kbin", binFile)

	table := pgx.Identifier{"kcat_" + b.fn}.Sanitize()
	fn := runtime.Function{
		Name: b.fn, Topic: b.topic,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` ("offset" bigint, key bytea, value bytea, tombstone bool, headers text)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			var hs []string
			for _, h := range rec.Headers {
				hs = append(hs, h.Key+"="+string(h.Value))
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2, $3, $4, $5)`,
				rec.Offset, rec.Key, rec.Value, rec.Tombstone(), strings.Join(hs, ","))
			return err
		},
	}
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "the first delivery has nothing to skip")
	// Deliver everything a second time: nothing may be applied twice. The
	// rewind must really have replayed the five records (else the check
	// below proves nothing): the inbox skipped each of them.
	execSQL(t, b, `UPDATE kfn.cursors SET next_offset = 0, high_water = 0 WHERE consumer = $1`, b.fn)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 5, "the rewind to offset 0 replays all five records, and the inbox skips them")

	type row struct {
		Offset    int64
		Key       []byte
		Value     []byte
		Tombstone bool
		Headers   string
	}
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT * FROM `+table+` ORDER BY "offset"`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	want := []row{
		{0, []byte("k1"), []byte("hello"), false, "trace=abc,src=kcat"},
		{1, []byte("k2"), []byte("world"), false, "trace=abc,src=kcat"},
		{2, []byte("k3"), nil, true, ""},
		{3, []byte("k4"), []byte{}, false, ""}, // an empty value is no tombstone
		{4, []byte("kbin"), binary, false, ""},
	}
	if len(got) != len(want) {
		t.Fatalf("applied %d records, want %d exactly once: %+v", len(got), len(want), got)
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Offset != w.Offset || !bytes.Equal(g.Key, w.Key) || !bytes.Equal(g.Value, w.Value) || g.Tombstone != w.Tombstone || g.Headers != w.Headers {
			t.Errorf("record %d = %+v, want %+v", i, g, w)
		}
	}
}
