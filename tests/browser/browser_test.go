package browser

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxui"
)

func TestMain(m *testing.M) { os.Exit(pgoutboxtest.Run(m)) }

// chromium finds Debian's chromium (or another Chrome); without one the
// test skips, unless PGOUTBOX_REQUIRE_BROWSER is set.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("PGOUTBOX_REQUIRE_BROWSER") != "" {
		t.Fatal("no chromium found (PGOUTBOX_REQUIRE_BROWSER is set): install it, e.g. apt-get install -y chromium")
	}
	t.Skip("no chromium found: install it (apt-get install -y chromium) to run the browser tests; set PGOUTBOX_REQUIRE_BROWSER=1 to fail instead of skipping")
	return ""
}

// bundle is one test's outbox, page and browser tab.
type bundle struct {
	env  *pgoutboxtest.Env
	ui   *pgoutboxui.UI
	base string // http://127.0.0.1:port/outbox/
	ctx  context.Context
}

func setup(t *testing.T) *bundle {
	t.Helper()
	path := chromium(t)
	env := pgoutboxtest.PubSub(t)
	require.NoError(t, env.Subscriber.Close())
	ui, err := pgoutboxui.New(env.Exec(), env.Tables, pgoutboxui.Options{BasePath: "/outbox/", Writes: true, SampleInterval: 200 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ui.Close() })
	mux := http.NewServeMux()
	mux.Handle("/outbox/", ui)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 1000),
	)
	ctx, cancelTab := chromedp.NewContext(alloc)
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	t.Cleanup(func() { cancelTimeout(); cancelTab(); cancelAlloc() })
	return &bundle{env: env, ui: ui, base: srv.URL + "/outbox/", ctx: ctx}
}

func (b *bundle) open(t *testing.T, path string) {
	t.Helper()
	require.NoError(t, chromedp.Do(b.ctx, chromedp.Navigate(b.base+path)))
}

// click clicks and waits for the page it loads.
func (b *bundle) click(t *testing.T, sel string) {
	t.Helper()
	_, err := chromedp.Run(b.ctx, chromedp.WaitEvent(page.LoadEventFired, nil, chromedp.Click(chromedp.CSS(sel))))
	require.NoError(t, err, sel)
}

func (b *bundle) text(t *testing.T, sel string) string {
	t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Text(chromedp.CSS(sel)))
	require.NoError(t, err, sel)
	return strings.TrimSpace(s)
}

func (b *bundle) js(t *testing.T, expr string) string {
	t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Evaluate[string](expr))
	require.NoError(t, err, expr)
	return s
}

// overviewCell reloads the overview until fn holds for the text of a cell
// of topic and group (class cell: ready, dead), as the sampler catches up.
func (b *bundle) overviewCell(t *testing.T, topic, group, cell string, fn func(string) bool) {
	t.Helper()
	sel := fmt.Sprintf(`tr[data-topic=%q][data-group=%q] td.%s`, topic, group, cell)
	var last string
	deadline := time.Now().Add(20 * time.Second)
	for {
		b.open(t, "")
		last = b.js(t, fmt.Sprintf(`(document.querySelector(%q) || {textContent: "(no row)"}).textContent.trim()`, sel))
		if fn(last) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("overview cell %s of %s/%s is %q", cell, topic, group, last)
		}
		time.Sleep(100 * time.Millisecond) // the sampler's next sample (every 200 ms)
	}
}

func number(s string) int {
	n, err := strconv.Atoi(strings.ReplaceAll(s, "\u202f", ""))
	if err != nil {
		return -1
	}
	return n
}

func is(n int) func(string) bool { return func(s string) bool { return number(s) == n } }

func msgs(n int, prefix string) []*message.Message {
	out := make([]*message.Message, n)
	for i := range out {
		out[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"%s": %d}`, prefix, i)))
	}
	return out
}

// The overview follows publishing: a topic's ready count changes after a
// publish, as the page shows it.
func TestBrowserOverviewFollowsPublishing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.NoError(t, pgoutbox.Bind(context.Background(), b.env.Exec(), b.env.Tables, "orders", "billing"))
	b.overviewCell(t, "orders", "billing", "ready", is(0))
	require.NoError(t, b.env.Publisher.Publish("orders", msgs(3, "order")...))
	b.overviewCell(t, "orders", "billing", "ready", is(3))
	require.Equal(t, "Overview · pgoutbox", b.js(t, "document.title"))
	b.click(t, `tr[data-topic="orders"][data-group="billing"] a`)
	require.Equal(t, "3", b.text(t, "#group-stats td.ready"))
}

// A message that failed is a dead letter; opened in the page and requeued
// from it, it is consumed.
func TestBrowserRequeueDeadLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.ConsumerGroup = "billing"
		c.RetryPolicy = pgoutbox.NoRetry()
	})
	ch, err := sub.Subscribe(context.Background(), "orders")
	require.NoError(t, err)
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42,"note":"card declined"}`))
	require.NoError(t, b.env.Publisher.Publish("orders", m))
	first := receive(t, ch)
	require.Equal(t, m.UUID, first.UUID)
	first.Nack() // NoRetry: dead-lettered
	b.overviewCell(t, "orders", "billing", "dead", is(1))

	b.open(t, "dead-letters")
	b.click(t, "a.dl-link")
	require.Contains(t, b.text(t, "pre.payload"), `"order": 42`, "the payload, pretty-printed")
	b.click(t, "#requeue-one")
	require.Equal(t, "1", b.text(t, "#confirm-rows"))
	b.click(t, "#confirm-button")
	require.Contains(t, b.text(t, ".flash"), "Requeued 1 dead letter.")

	again := receive(t, ch)
	require.Equal(t, m.UUID, again.UUID, "the requeued message is delivered again")
	again.Ack()
	b.overviewCell(t, "orders", "billing", "dead", is(0))
	b.overviewCell(t, "orders", "billing", "ready", is(0))
}

// Pausing a group from its page stops its consumption: its backlog grows
// while the topic's other group drains; resuming from the page drains it.
func TestBrowserPauseResume(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	chans := map[string]<-chan *message.Message{}
	for _, g := range []string{"a", "b"} {
		require.NoError(t, pgoutbox.Bind(ctx, b.env.Exec(), b.env.Tables, "orders", g))
		sub := b.env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = g })
		ch, err := sub.Subscribe(ctx, "orders")
		require.NoError(t, err)
		chans[g] = ch
	}
	b.open(t, "group?topic=orders&group=a")
	b.click(t, "#pause-button")
	require.Contains(t, b.text(t, ".confirm"), "Pause group a")
	b.click(t, "#confirm-button")
	require.Equal(t, "paused", b.text(t, "#paused-badge"))

	require.NoError(t, b.env.Publisher.Publish("orders", msgs(20, "n")...))
	for range 20 {
		receive(t, chans["b"]).Ack()
	}
	b.overviewCell(t, "orders", "b", "ready", is(0))
	b.overviewCell(t, "orders", "a", "ready", is(20))
	require.Contains(t, b.js(t, `document.querySelector('tr[data-topic="orders"][data-group="a"]').className`), "paused")
	select {
	case m := <-chans["a"]:
		t.Fatalf("the paused group received %s", m.Payload)
	default:
	}

	b.open(t, "group?topic=orders&group=a")
	b.click(t, "#resume-button")
	require.Equal(t, "20", b.text(t, "#confirm-rows"))
	b.click(t, "#confirm-button")
	require.Contains(t, b.text(t, ".flash"), "Resumed group a")
	for range 20 {
		receive(t, chans["a"]).Ack()
	}
	b.overviewCell(t, "orders", "a", "ready", is(0))
}

// HTML and script in a topic, a group, a payload, metadata and an error
// are shown as text: nothing runs, no element is made of them.
func TestBrowserEscaping(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	evil := `<script>window.pwned=1</script><img src=x onerror="window.pwned=2"><b id=injected>b</b>`
	topic, group := "t"+evil, "g"+evil
	require.NoError(t, pgoutbox.Bind(ctx, b.env.Exec(), b.env.Tables, topic, group))
	m := message.NewMessage(watermill.NewUUID(), []byte(evil))
	m.Metadata.Set(evil, evil)
	require.NoError(t, b.env.Publisher.Publish(topic, m))
	_, err := b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET last_error = $1`, b.env.Schema, b.env.Tables.Table), evil)
	require.NoError(t, err)
	_, err = b.env.Pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s.%s (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, last_error, failure_reason)
VALUES (777, $1, $2, 'u', convert_to($3, 'UTF8'), jsonb_build_object($3::text, $3::text), now(), 3, $3, $3)`, b.env.Schema, b.env.Tables.DeadLetterTable), topic, group, evil)
	require.NoError(t, err)

	b.overviewCell(t, topic, group, "ready", is(1))
	check := func(where string) {
		t.Helper()
		require.Equal(t, "undefined", b.js(t, "String(window.pwned)"), where)
		require.Equal(t, "0", b.js(t, "String(document.querySelectorAll('img, #injected').length)"), where)
		require.Equal(t, "1", b.js(t, "String(document.scripts.length)"), "%s: only the page's own script", where)
		require.Contains(t, b.js(t, "document.body.innerText"), "window.pwned=1", "%s: shown as text", where)
	}
	check("overview")
	b.click(t, fmt.Sprintf(`tr[data-topic=%q] a`, topic))
	_, err = chromedp.Run(b.ctx, chromedp.Evaluate[bool](`document.querySelectorAll('details').forEach(d => d.open = true), true`))
	require.NoError(t, err)
	check("group page")
	b.open(t, "dead-letters")
	check("dead letters")
	b.open(t, "dead-letter?id=777")
	check("dead letter")
	b.click(t, "a[href*='group?']")
	b.click(t, "#pause-button")
	check("confirmation")
}

func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "channel closed")
		return m
	case <-time.After(15 * time.Second):
		t.Fatal(errors.New("no message within 15s"))
		return nil
	}
}
