package browsertest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/console"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// fn is the running function of the test: effects' test function, with
// KeyOrder ParkKey, failing permanently on a value "poison N" or "hostile…"
// until fixed.
type fn struct {
	fixed atomic.Bool
	def   runtime.Function
}

func newFunction(name, topic string) *fn {
	f := &fn{def: effects.Function(name, topic)}
	apply := f.def.Handler
	f.def.KeyOrder = runtime.ParkKey
	f.def.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		v := string(rec.Value)
		switch {
		case strings.HasPrefix(v, "hostile"):
			return runtime.Permanent(errors.New(`hostile record "><img src=x onerror=alert(11)>`))
		case strings.HasPrefix(v, "frozen ") && !f.fixed.Load():
			return runtime.Permanent(fmt.Errorf("account %s is frozen", strings.TrimPrefix(v, "frozen ")))
		case strings.HasPrefix(v, "poison ") && !f.fixed.Load():
			return runtime.Permanent(fmt.Errorf("cannot decode order %s at offset %d", strings.TrimPrefix(v, "poison "), rec.Offset))
		}
		return apply(ctx, tx, rec, out)
	}
	return f
}

// browser records what a page must never do: open a dialog or throw.
type browser struct {
	mu      sync.Mutex
	dialogs []string
	errors  []string
}

func (b *browser) listen(ctx context.Context) {
	if err := chromedp.Listen(ctx, func(ev any) {
		if e, ok := ev.(*page.EventJavascriptDialogOpening); ok {
			b.mu.Lock()
			b.dialogs = append(b.dialogs, e.Message)
			b.mu.Unlock()
			go chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false}) //nolint:errcheck // only unblocks the page
		}
	}); err != nil {
		panic(err)
	}
	go func() {
		for m, err := range chromedp.Console(ctx) {
			if err != nil {
				return
			}
			if m.IsException() || m.Type == "error" {
				b.mu.Lock()
				b.errors = append(b.errors, m.String()+" at "+m.URL)
				b.mu.Unlock()
			}
		}
	}()
}

// expect401 drops the console's record of the 401 of the first page (the
// login form, before the login), and fails t on anything else.
func (b *browser) expect401(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.dialogs) > 0 || len(b.errors) != 1 || !strings.Contains(b.errors[0], "401") {
		t.Fatalf("before the login: dialogs %q, errors %q; want only the 401 of the first page", b.dialogs, b.errors)
	}
	b.errors = nil
}

func (b *browser) check(t *testing.T, where string) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.dialogs) > 0 || len(b.errors) > 0 {
		t.Fatalf("%s: dialogs %q, script errors %q", where, b.dialogs, b.errors)
	}
}

// shoot writes a screenshot of the page to $KFN_CONSOLE_SCREENSHOTS/name.png.
func shoot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	dir := os.Getenv("KFN_CONSOLE_SCREENSHOTS")
	if dir == "" {
		return
	}
	png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644); err != nil {
		t.Fatal(err)
	}
}

// run runs browser actions, failing t with what was being done.
func run(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := chromedp.Do(c, actions...); err != nil {
		html, _ := chromedp.Run(ctx, chromedp.OuterHTML(chromedp.CSS("body")))
		url, _ := chromedp.Run(ctx, chromedp.Location())
		t.Fatalf("%s: %v; the page at %s:\n%.3000s", what, err, url, html)
	}
}

// evalNow evaluates js once.
func evalNow(t *testing.T, ctx context.Context, js string) bool {
	t.Helper()
	ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](js))
	if err != nil {
		t.Fatalf("%s: %v", js, err)
	}
	return ok
}

// evalUntil evaluates js every 200 ms until it returns true.
func evalUntil(t *testing.T, ctx context.Context, what, js string, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](js))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			html, _ := chromedp.Run(ctx, chromedp.OuterHTML(chromedp.CSS("main")))
			t.Fatalf("timed out after %s waiting for %s; the page:\n%.3000s", limit, what, html)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func TestOnCallWorkflowInARealBrowser(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	topic := k.CreateTopic(t, 1)
	name := kfntest.Name(t, "console")
	bucket := kfntest.Name(t, "leases")
	f := newFunction(name, topic)
	ctx := context.Background()

	// Three poison records (one group), a parked key (its head and a later
	// record of the key), a hostile record, and good records between.
	msgs := []kafka.Message{
		{Key: []byte("a"), Value: []byte("ok 1")},
		{Key: []byte("p1"), Value: []byte("poison 101")},
		{Key: []byte("p2"), Value: []byte("poison 102")},
		{Key: []byte("acct-9"), Value: []byte("frozen 900")},
		{Key: []byte("p3"), Value: []byte("poison 103")},
		{Key: []byte("acct-9"), Value: []byte("ok acct-9 later")},
		{Key: []byte(`<script>alert(1)</script>`), Value: []byte("hostile \"><img src=x onerror=alert(2)>\xff\xfe\x00<script>alert(3)</script>"),
			Headers: []kafka.Header{{Key: "<script>alert(4)</script>", Value: []byte(`"><img src=x onerror=alert(5)>`)}, {Key: "nul\x00name\xff", Value: []byte{0}}}},
		{Key: []byte("b"), Value: []byte("ok 2")},
	}
	k.Produce(t, topic, msgs...)
	cfg := runtime.Config{KafkaBrokers: k.Brokers, DatabaseURL: db.URL, NATSURL: natsURL, WorkerID: "worker-1",
		LeaseTTL: 2 * time.Second, LeaseRenew: 500 * time.Millisecond, LeaseBucket: bucket, RetryAttempts: 1, RetryInitial: 10 * time.Millisecond}
	startWorker := func(id string) func() {
		c := cfg
		c.WorkerID = id
		w, err := worker.New(ctx, c, f.def)
		if err != nil {
			t.Fatal(err)
		}
		return kfntest.Background(t, id, w.Run)
	}
	count := func(sql string, args ...any) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	stop := startWorker("worker-1")
	kfntest.Await(t, 30*time.Second, "6 dead letters and the cursor at 8", func() (bool, string) {
		n := count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1`, name)
		c := count(`SELECT coalesce(max(next_offset), 0) FROM kfn.cursors WHERE consumer = $1`, name)
		return n == 6 && c == 8, fmt.Sprintf("%d dead letters, cursor %d", n, c)
	})
	// The lag builds up while no worker runs.
	stop()
	for i := range 300 {
		k.Produce(t, topic, kafka.Message{Key: []byte(fmt.Sprintf("k%d", i%7)), Value: []byte(fmt.Sprintf("ok %d", i))})
	}

	nc, js, err := connect.NATSWith(natsURL, "console browser test", runtime.NATSSecurity{})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	users, err := console.ParseAuthFile(strings.NewReader("alice:writer:sha256:" + sha256Hex("alice-secret") + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := console.New(console.Config{Pool: db.Pool, JS: js, KafkaBrokers: k.Brokers, LeaseBucket: bucket, Users: users, AllowWrites: true, Log: slog.Default()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hs := httptest.NewServer(srv)
	defer hs.Close()
	base := hs.URL

	chromium := os.Getenv("KFN_CHROMIUM")
	if chromium == "" {
		chromium = "/usr/bin/chromium"
	}
	if _, err := os.Stat(chromium); err != nil {
		t.Fatalf("no Chromium at %s (apt-get install chromium, or set KFN_CHROMIUM): %v", chromium, err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.WindowSize(1400, 1000))
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	b := &browser{}
	b.listen(bctx)

	// Log in.
	run(t, bctx, "log in",
		chromedp.Navigate(base+"/"),
		chromedp.WaitVisible(chromedp.CSS("#user")),
		chromedp.SendKeys(chromedp.CSS("#user"), "alice"),
		chromedp.SendKeys(chromedp.CSS("#secret"), "alice-secret"),
	)
	shoot(t, bctx, "login")
	run(t, bctx, "submit the login form", chromedp.Click(chromedp.CSS("#login")), chromedp.WaitVisible(chromedp.CSS("#lanes")))
	b.expect401(t) // the first page, before the login

	// The overview shows the lag; a worker starts and the live refresh
	// shows it fall to 0, with no page reload (the marker survives).
	lagSum := `[...document.querySelectorAll('#lanes td.lag')].reduce((s, td) => s + (parseInt(td.textContent, 10) || 0), 0)`
	evalUntil(t, bctx, "a lag of 300 on the overview", lagSum+` >= 300`, 10*time.Second)
	shoot(t, bctx, "overview")
	evalUntil(t, bctx, "a mark on the page", `(window.kfnMarker = 42) === 42`, time.Second)
	stop = startWorker("worker-2")
	defer stop()
	// More records arrive while the worker catches up; the page, refreshed
	// live, shows the lag below the 300 it had before they are all sent.
	lowest := int64(300)
	for i := range 10 {
		for j := range 20 {
			k.Produce(t, topic, kafka.Message{Key: []byte(fmt.Sprintf("k%d", j%7)), Value: []byte(fmt.Sprintf("ok more %d", i*20+j))})
		}
		lag, err := chromedp.Run(bctx, chromedp.Evaluate[int64](lagSum))
		if err != nil {
			t.Fatal(err)
		}
		lowest = min(lowest, lag)
		time.Sleep(300 * time.Millisecond)
	}
	if lowest >= 300 {
		t.Fatalf("the overview's lag never fell below 300 while 200 more records were produced")
	}
	evalUntil(t, bctx, "the lag to fall to 0 on the live overview", lagSum+` === 0 && document.querySelectorAll('#lanes td.lag').length > 0`, time.Minute)
	evalUntil(t, bctx, "no page reload", `window.kfnMarker === 42`, time.Second)

	// Open the group of the poison records.
	run(t, bctx, "open the dead letters", chromedp.Navigate(base+"/deadletters"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	shoot(t, bctx, "deadletters")
	run(t, bctx, "open the poison group",
		chromedp.Click(`//a[@class="group"][contains(., "cannot decode order")][contains(., "permanent")]`),
		chromedp.WaitVisible(chromedp.CSS("#letters")))
	evalUntil(t, bctx, "the group's 3 letters", `document.querySelectorAll('#letters tbody tr[data-id]').length === 3`, 5*time.Second)
	shoot(t, bctx, "group")

	// Retry one record once fixed, and see it applied: its row leaves the
	// group's table, and the function's table holds its effect.
	f.fixed.Store(true)
	groupURL, err := chromedp.Run(bctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	firstID, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.querySelector('#letters tbody tr[data-id]').dataset.id`))
	if err != nil {
		t.Fatal(err)
	}
	run(t, bctx, "open the first letter", chromedp.Click(chromedp.CSS(`#letters tbody tr[data-id] a`)), chromedp.WaitVisible(chromedp.CSS("#retry-letter")),
		chromedp.SendKeys(chromedp.CSS("#letter-reason"), "INC-12: decoder fixed"), chromedp.Click(chromedp.CSS("#retry-letter")),
		chromedp.WaitVisible(chromedp.CSS("#marked")))
	evalUntil(t, bctx, "the retry marked", `document.querySelector('#marked').textContent.includes('marked for retry')`, 5*time.Second)
	deadline := time.Now().Add(30 * time.Second)
	for {
		run(t, bctx, "reload the group", chromedp.Navigate(groupURL), chromedp.WaitVisible(chromedp.CSS("#letters")))
		if gone := evalNow(t, bctx, fmt.Sprintf(`document.querySelector('#letters tr[data-id="%s"]') === null`, firstID)); gone {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead letter %s still in its group 30 s after its retry", firstID)
		}
		time.Sleep(300 * time.Millisecond)
	}
	if n := count(`SELECT count(*) FROM ` + effects.Table(name) + ` WHERE value LIKE 'poison%'`); n != 1 {
		t.Fatalf("%d poison records applied after one retry, want 1", n)
	}

	// Discard the rest of the group with a reason.
	run(t, bctx, "discard the group", chromedp.SendKeys(chromedp.CSS("#group-reason"), "INC-13: orders cancelled upstream"),
		chromedp.Click(chromedp.CSS("#discard-group")), chromedp.WaitVisible(chromedp.CSS(".notice")))
	evalUntil(t, bctx, "the discard's notice", `document.querySelector('.notice').textContent.includes('Discarded')`, 5*time.Second)

	// Both actions are in the audit log under the console user.
	run(t, bctx, "open the audit log", chromedp.Navigate(base+"/audit?actor=console%3Aalice"), chromedp.WaitVisible(chromedp.CSS("#audit")))
	evalUntil(t, bctx, "alice's retry and discard in the audit log",
		`(() => { const rows = [...document.querySelectorAll('#audit tbody tr')].map(r => r.querySelector('.actor').textContent + ' ' + r.querySelector('.action').textContent);
		  return rows.includes('console:alice dlq_retry_requested') && rows.includes('console:alice discard'); })()`, 5*time.Second)
	shoot(t, bctx, "audit")

	// The parked key: release it by retrying its head, now fixed.
	run(t, bctx, "open the parked keys", chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS("#parked")))
	evalUntil(t, bctx, "the parked key acct-9", `document.querySelector('#parked').textContent.includes('acct-9')`, 5*time.Second)
	shoot(t, bctx, "parked")
	run(t, bctx, "retry the parked key's head", chromedp.Click(`//table[@id="parked"]//tr[contains(., "acct-9")]//a`), chromedp.WaitVisible(chromedp.CSS("#retry-letter")),
		chromedp.SendKeys(chromedp.CSS("#letter-reason"), "INC-14: account fixed"), chromedp.Click(chromedp.CSS("#retry-letter")),
		chromedp.WaitVisible(chromedp.CSS("#marked")))
	deadline = time.Now().Add(30 * time.Second)
	for {
		run(t, bctx, "reload the parked keys", chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS("#parked")))
		if released := evalNow(t, bctx, `!document.querySelector('#parked').textContent.includes('acct-9')`); released {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the key is still parked 30 s after its head was retried")
		}
		time.Sleep(300 * time.Millisecond)
	}

	// The hostile record's page: the bytes are text and hex, nothing ran.
	var hostileID int64
	if err := db.Pool.QueryRow(ctx, `SELECT id FROM kfn.dead_letters WHERE consumer = $1 AND value LIKE 'hostile%'`, name).Scan(&hostileID); err != nil {
		t.Fatal(err)
	}
	run(t, bctx, "open the hostile record", chromedp.Navigate(fmt.Sprintf("%s/deadletters/%d", base, hostileID)), chromedp.WaitVisible(chromedp.CSS("#value")))
	evalUntil(t, bctx, "the hostile bytes as inert text",
		`document.querySelectorAll('img, svg, iframe').length === 0 && document.scripts.length === 1 &&
		 document.querySelector('#key').textContent.includes('<script>alert(1)</script>') &&
		 document.querySelector('#value').textContent.includes('hex') &&
		 document.querySelector('#headers').textContent.includes('<script>alert(4)</script>') &&
		 document.querySelector('#error').textContent.includes('onerror=alert(11)')`, 5*time.Second)
	shoot(t, bctx, "deadletter")
	b.check(t, "the hostile record's page")

	// Replay partition 0 from offset 0: the dry run's plan first, then
	// confirmed; the cursor moves back and the worker brings it forward,
	// skipping what it handled.
	var hw int64
	if err := db.Pool.QueryRow(ctx, `SELECT high_water FROM kfn.cursors WHERE consumer = $1`, name).Scan(&hw); err != nil {
		t.Fatal(err)
	}
	run(t, bctx, "plan a replay", chromedp.Navigate(base+"/replay"), chromedp.WaitVisible(chromedp.CSS("#plan-form")),
		chromedp.SendKeys(chromedp.CSS(`input[name="function"]`), name), chromedp.SendKeys(chromedp.CSS(`input[name="topic"]`), topic),
		chromedp.SendKeys(chromedp.CSS(`input[name="partition"]`), "0"), chromedp.SendKeys(chromedp.CSS(`input[name="from"]`), "0"),
		chromedp.Click(chromedp.CSS("#plan")), chromedp.WaitVisible(chromedp.CSS("#plan-table")))
	shoot(t, bctx, "replay")
	if n := count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'replay'`); n != 0 {
		t.Fatalf("the dry run wrote %d replay audit rows", n)
	}
	run(t, bctx, "confirm the replay", chromedp.Click(chromedp.CSS("#confirm")), chromedp.WaitVisible(chromedp.CSS(".notice")))
	if n := count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'replay' AND actor = 'console:alice'`); n != 1 {
		t.Fatalf("%d replay audit rows by console:alice, want 1", n)
	}
	run(t, bctx, "open the overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#lanes")))
	evalUntil(t, bctx, fmt.Sprintf("the cursor back at %d after the replay", hw),
		fmt.Sprintf(`[...document.querySelectorAll('#lanes td.cursor')].some(td => td.textContent.trim() === '%d')`, hw), time.Minute)
	if n := count(`SELECT count(*) - count(DISTINCT (partition, "offset")) FROM ` + effects.Table(name)); n != 0 {
		t.Fatalf("%d records applied twice after the idempotent replay", n)
	}

	// Verify: clean.
	run(t, bctx, "run verify", chromedp.Navigate(fmt.Sprintf("%s/verify?function=%s&topic=%s", base, name, topic)), chromedp.WaitVisible(chromedp.CSS("#verdict")))
	evalUntil(t, bctx, "a clean verdict", `document.querySelector('#verdict').textContent.startsWith('Clean')`, time.Second)
	shoot(t, bctx, "verify")
	b.check(t, "the whole run")
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}
