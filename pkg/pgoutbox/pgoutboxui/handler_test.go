package pgoutboxui_test

import (
	"bytes"
	"context"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxui"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// bundle is one test's outbox and the page served over HTTP.
type bundle struct {
	env    *pgoutboxtest.Env
	srv    *httptest.Server
	client *http.Client
	base   string // the page's URL, BasePath included
	ui     *pgoutboxui.UI
}

func setup(t *testing.T, writes bool) *bundle {
	t.Helper()
	return setupWith(t, pgoutboxui.Options{Writes: writes})
}

// setupWith serves a page with opts, at /ops/outbox/ and sampling every
// 100 ms.
func setupWith(t *testing.T, opts pgoutboxui.Options) *bundle {
	t.Helper()
	env := pgoutboxtest.PubSub(t)
	require.NoError(t, env.Subscriber.Close()) // the tests consume with subscribers of their own, or not at all
	opts.BasePath, opts.SampleInterval = "/ops/outbox/", 100*time.Millisecond
	ui, err := pgoutboxui.New(env.Exec(), env.Tables, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ui.Close() })
	mux := http.NewServeMux()
	mux.Handle("/ops/outbox/", ui)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	client := &http.Client{Jar: jar, Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return &bundle{env: env, srv: srv, client: client, base: srv.URL + "/ops/outbox/", ui: ui}
}

func (b *bundle) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := b.client.Get(b.base + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

func (b *bundle) page(t *testing.T, path string) string {
	t.Helper()
	code, body := b.get(t, path)
	require.Equal(t, http.StatusOK, code, body)
	return body
}

func (b *bundle) post(t *testing.T, path string, form url.Values) (*http.Response, string) {
	t.Helper()
	resp, err := b.client.PostForm(b.base+path, form)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(body)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrf reads the form token of a page (and gets the cookie it belongs to).
func (b *bundle) csrf(t *testing.T) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(b.page(t, "dead-letters"))
	require.NotNil(t, m, "the page has a CSRF field")
	return html.UnescapeString(m[1])
}

var rowsRE = regexp.MustCompile(`id="confirm-rows">([^<]+)<`)

// act posts an action to confirm, checks the number of rows it announces,
// posts the confirmation and returns the page it redirects to.
func (b *bundle) act(t *testing.T, form url.Values, rows int) string {
	t.Helper()
	return b.actAfter(t, form, rows, func() {})
}

// actAfter is act with between run after the confirmation, before its
// Confirm is posted.
func (b *bundle) actAfter(t *testing.T, form url.Values, rows int, between func()) string {
	t.Helper()
	form.Set("csrf", b.csrf(t))
	resp, body := b.post(t, "confirm", form)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	m := rowsRE.FindStringSubmatch(body)
	require.NotNil(t, m, body)
	require.Equal(t, fmt.Sprint(rows), strings.ReplaceAll(m[1], "\u202f", ""), "the confirmation counts the rows")
	// The confirmation page's own form, as a browser would post it.
	fields := url.Values{}
	for _, f := range regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`).FindAllStringSubmatch(body, -1) {
		fields.Add(html.UnescapeString(f[1]), html.UnescapeString(f[2]))
	}
	between()
	resp, body = b.post(t, "do", fields)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode, body)
	loc := resp.Header.Get("Location")
	require.True(t, strings.HasPrefix(loc, "/ops/outbox/"), loc)
	return b.page(t, strings.TrimPrefix(loc, "/ops/outbox/"))
}

func (b *bundle) exec() tx.Executor { return b.env.Exec() }

// deadLetters inserts n dead letters of topic and group.
func (b *bundle) deadLetters(t *testing.T, topic, group, reason string, n int, lastError string) {
	t.Helper()
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
INSERT INTO %[1]s.%[2]s (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, last_error, failure_reason, failed_at)
SELECT (SELECT coalesce(max(id), 999) FROM %[1]s.%[2]s) + g, $1, $2, gen_random_uuid()::text, convert_to('{"n": ' || g || '}', 'UTF8'), '{}', now(), 5, $4, $3, now() - g * interval '1 minute'
  FROM generate_series(1, $5::int) g`, b.env.Schema, b.env.Tables.DeadLetterTable), topic, group, reason, lastError, n)
	require.NoError(t, err)
}

func (b *bundle) dlqCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), fmt.Sprintf(`SELECT count(*) FROM %s.%s`, b.env.Schema, b.env.Tables.DeadLetterTable)).Scan(&n))
	return n
}

func publish(t *testing.T, b *bundle, topic string, msgs ...*message.Message) {
	t.Helper()
	require.NoError(t, b.env.Publisher.Publish(topic, msgs...))
}

func msg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

// The overview lists every topic and group with its counts from the
// sampler, marks a group with rows and no binding, and a paused group.
func TestOverview(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, "orders", "billing"))
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, "orders", "old"))
	publish(t, b, "orders", msg("1"), msg("2"), msg("3"))
	_, err := pgoutbox.Unbind(ctx, b.exec(), b.env.Tables, "orders", "old", false) // its 3 rows are stranded
	require.NoError(t, err)
	publish(t, b, "unbound", msg("x")) // nobody bound the topic: the default group's row waits
	// The only group of a topic unbound with its rows: no binding is
	// left, and no later binding takes them (they are not the default
	// group's): stranded, not waiting.
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, "invoices", "g1"))
	publish(t, b, "invoices", msg("i1"), msg("i2"))
	_, err = pgoutbox.Unbind(ctx, b.exec(), b.env.Tables, "invoices", "g1", false)
	require.NoError(t, err)
	require.NoError(t, pgoutbox.PauseGroup(ctx, b.exec(), b.env.Tables, "orders", "billing"))

	var body string
	require.Eventually(t, func() bool {
		body = b.page(t, "")
		return strings.Contains(body, `data-topic="unbound"`) && strings.Contains(body, "paused")
	}, 10*time.Second, 50*time.Millisecond)
	row := regexp.MustCompile(`(?s)<tr class="([^"]*)" data-topic="orders" data-group="billing">(.*?)</tr>`).FindStringSubmatch(body)
	require.NotNil(t, row, body)
	require.Contains(t, row[1], "paused")
	require.Contains(t, row[2], `<td class="n ready">3</td>`)
	stranded := regexp.MustCompile(`(?s)<tr class="([^"]*)" data-topic="orders" data-group="old">`).FindStringSubmatch(body)
	require.NotNil(t, stranded)
	require.Contains(t, stranded[1], "stranded")
	require.Contains(t, body, `<strong>2</strong> groups hold rows without a binding`)
	alone := regexp.MustCompile(`(?s)<tr class="([^"]*)" data-topic="invoices" data-group="g1">(.*?)</tr>`).FindStringSubmatch(body)
	require.NotNil(t, alone, body)
	require.Contains(t, alone[1], "stranded")
	require.NotContains(t, alone[2], "no subscriber yet")
	group := b.page(t, "group?topic=invoices&group=g1")
	require.Contains(t, group, `<span class="badge stranded">no binding</span>`)
	require.Contains(t, group, "its rows are stranded")
	require.Contains(t, b.page(t, "group?topic=unbound&group="), `<span class="badge waiting">no subscriber yet</span>`)
	waiting := regexp.MustCompile(`(?s)<tr class="([^"]*)" data-topic="unbound" data-group="">(.*?)</tr>`).FindStringSubmatch(body)
	require.NotNil(t, waiting)
	require.NotContains(t, waiting[1], "stranded")
	require.Contains(t, waiting[2], "no subscriber yet")
	require.Contains(t, body, "<svg", "charts are inline SVG")

	// Counts follow publishing, from the next sample.
	publish(t, b, "orders", msg("4"))
	require.Eventually(t, func() bool {
		return strings.Contains(b.page(t, ""), `<td class="n ready">4</td>`)
	}, 10*time.Second, 50*time.Millisecond)
}

// A page closed before it sampled (a service shutting down while its HTTP
// server drains) serves the overview at once, without a sample: it waited
// 10 s for a first sample that would never come.
func TestOverviewAfterCloseDoesNotWaitForASample(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	require.NoError(t, b.ui.Close())
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.base, nil)
		require.NoError(t, err)
		resp, err := b.client.Do(req)
		require.NoError(t, err, "the overview waited for a sampler that was closed")
		require.Equal(t, http.StatusOK, resp.StatusCode)
		resp.Body.Close()
		cancel()
	}
}

// Read-only (the default): no form, no token, and every POST is refused
// with 403 without touching anything.
func TestReadOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	b.deadLetters(t, "t", "", "rejected", 2, "boom")
	for _, p := range []string{"", "dead-letters", "group?topic=t&group=", "dead-letter?id=1000"} {
		body := b.page(t, p)
		require.NotContains(t, body, `method="post"`, p)
		require.NotContains(t, body, `name="csrf"`, p)
		require.Contains(t, body, "read-only", p)
	}
	for _, action := range []url.Values{
		{"action": {"requeue"}, "id": {"1000"}}, {"action": {"delete"}, "id": {"1000"}},
		{"action": {"purge"}, "older_than": {"0s"}}, {"action": {"pause"}, "topic": {"t"}, "group": {""}},
	} {
		for _, step := range []string{"confirm", "do"} {
			resp, body := b.post(t, step, action)
			require.Equal(t, http.StatusForbidden, resp.StatusCode, body)
			require.Contains(t, body, "read-only")
		}
	}
	require.Equal(t, 2, b.dlqCount(t))
	paused, err := pgoutbox.PausedGroups(context.Background(), b.exec(), b.env.Tables, "")
	require.NoError(t, err)
	require.Empty(t, paused)
}

// A write without the CSRF token, with a forged one, without the cookie
// it belongs to, or from another site is refused; nothing changes.
func TestCSRFRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "t", "", "rejected", 1, "boom")
	token := b.csrf(t)
	form := func(tok string) url.Values { return url.Values{"action": {"delete"}, "id": {"1000"}, "csrf": {tok}} }
	nonce, _, _ := strings.Cut(token, ".")
	for name, f := range map[string]url.Values{
		"no token":    {"action": {"delete"}, "id": {"1000"}},
		"forged":      form(nonce + ".00ff"),
		"other nonce": form(strings.Repeat("ab", 16) + "." + strings.Split(token, ".")[1]),
		"empty":       form(""),
	} {
		for _, step := range []string{"confirm", "do"} {
			resp, body := b.post(t, step, f)
			require.Equal(t, http.StatusForbidden, resp.StatusCode, "%s, %s: %s", name, step, body)
			require.Contains(t, body, "refused", name)
		}
	}
	// The right token without its cookie (another browser).
	resp, err := http.PostForm(b.base+"do", form(token))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	// The right token and cookie, posted from another site.
	req, err := http.NewRequest(http.MethodPost, b.base+"do", strings.NewReader(form(token).Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://evil.example")
	resp, err = b.client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Equal(t, 1, b.dlqCount(t), "nothing was deleted")
	// A GET cannot act.
	code, _ := b.get(t, "do?action=delete&id=1000&csrf="+url.QueryEscape(token))
	require.Equal(t, http.StatusMethodNotAllowed, code)
	require.Equal(t, 1, b.dlqCount(t))
}

// Behind a reverse proxy that sends its upstream's Host (nginx's default,
// httputil.ReverseProxy with SetURL), a browser's same-site write passes:
// by its Sec-Fetch-Site, or by the forwarded host. Every write was refused.
func TestWritesPassBehindAProxyThatRewritesHost(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "t", "", "rejected", 1, "boom")
	upstream, err := url.Parse(b.srv.URL)
	require.NoError(t, err)
	for name, c := range map[string]struct {
		forwarded bool   // the proxy sets X-Forwarded-Host
		fetchSite string // what the browser sends
		passes    bool
	}{
		"forwarded host":        {forwarded: true, passes: true},
		"same-origin browser":   {fetchSite: "same-origin", passes: true},
		"neither":               {passes: false},
		"cross-site, forwarded": {forwarded: true, fetchSite: "cross-site", passes: false},
	} {
		t.Run(name, func(t *testing.T) {
			proxy := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(upstream)
				if c.forwarded {
					pr.SetXForwarded()
				}
			}})
			t.Cleanup(proxy.Close)
			jar, err := cookiejar.New(nil)
			require.NoError(t, err)
			client := &http.Client{Jar: jar, Timeout: 30 * time.Second}
			resp, err := client.Get(proxy.URL + "/ops/outbox/dead-letters")
			require.NoError(t, err)
			page, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			m := csrfRE.FindStringSubmatch(string(page))
			require.NotNil(t, m, "the page has a CSRF field")
			form := url.Values{"action": {"delete"}, "id": {"1000"}, "csrf": {html.UnescapeString(m[1])}}
			req, err := http.NewRequest(http.MethodPost, proxy.URL+"/ops/outbox/confirm", strings.NewReader(form.Encode()))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Origin", proxy.URL) // what a browser sends with a form's POST
			if c.fetchSite != "" {
				req.Header.Set("Sec-Fetch-Site", c.fetchSite)
			}
			resp, err = client.Do(req)
			require.NoError(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if c.passes {
				require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
				require.Contains(t, string(body), `id="confirm-rows"`)
				return
			}
			require.Equal(t, http.StatusForbidden, resp.StatusCode, string(body))
			if c.fetchSite == "" {
				require.Contains(t, string(body), "a reverse proxy in front that rewrites Host without passing it on")
			}
		})
	}
	require.Equal(t, 1, b.dlqCount(t), "confirmations change nothing")
}

// Requeue one dead letter from its page, then selected ones, then every
// one matching a filter: each confirmation counts the rows, the rows move
// back into the outbox, and the page says how many moved.
func TestRequeue(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "orders", "billing", "rejected", 3, "boom")        // 1000..1002
	b.deadLetters(t, "orders", "billing", "retry_exhausted", 4, "slow") // 1003..1006
	b.deadLetters(t, "other", "", "rejected", 2, "x")                   // 1007..1008

	one := b.page(t, "dead-letter?id=1000")
	require.Contains(t, one, `id="requeue-one"`)
	done := b.act(t, url.Values{"action": {"requeue"}, "id": {"1000"}, "return": {"/ops/outbox/dead-letter?id=1000"}}, 1)
	require.Contains(t, done, "Requeued 1 dead letter.")
	require.Equal(t, 8, b.dlqCount(t))

	done = b.act(t, url.Values{"action": {"requeue"}, "id": {"1001", "1002", "999999"}, "return": {"/ops/outbox/dead-letters"}}, 2)
	require.Contains(t, done, "Requeued 2 dead letters.")

	done = b.act(t, url.Values{"action": {"requeue-matching"}, "topic": {"orders"}, "gmode": {"is"}, "group": {"billing"},
		"reason": {"retry_exhausted"}, "return": {"/ops/outbox/dead-letters?topic=orders"}}, 4)
	require.Contains(t, done, "Requeued 4 dead letters.")
	require.Equal(t, 2, b.dlqCount(t), "the other topic's stay")

	s, err := pgoutbox.Stats(context.Background(), b.exec(), b.env.Tables, pgoutbox.StatsForGroup("orders", "billing"))
	require.NoError(t, err)
	require.EqualValues(t, 7, s[0].Ready)
}

// A requeue or purge by filter acts on what its confirmation counted: a
// letter that fails between the confirmation and its Confirm stays.
func TestActionsByFilterActOnWhatTheConfirmationCounted(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "orders", "billing", "rejected", 3, "boom")
	failsNow := func() {
		_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
INSERT INTO %[1]s.%[2]s (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, last_error, failure_reason, failed_at)
SELECT (SELECT max(id) FROM %[1]s.%[2]s) + 1, 'orders', 'billing', gen_random_uuid()::text, '\x7b7d', '{}', now(), 5, 'late', 'rejected', clock_timestamp()`,
			b.env.Schema, b.env.Tables.DeadLetterTable))
		require.NoError(t, err)
	}
	done := b.actAfter(t, url.Values{"action": {"requeue-matching"}, "topic": {"orders"}, "reason": {"rejected"},
		"return": {"/ops/outbox/dead-letters"}}, 3, failsNow)
	require.Contains(t, done, "Requeued 3 dead letters.")
	require.Equal(t, 1, b.dlqCount(t), "the letter that failed after the confirmation stays")

	done = b.actAfter(t, url.Values{"action": {"purge"}, "older_than": {"0"}, "return": {"/ops/outbox/dead-letters"}}, 1, failsNow)
	require.Contains(t, done, "Purged 1 dead letter.")
	require.Equal(t, 1, b.dlqCount(t), "the letter that failed after the confirmation stays")
}

// A dead letter goes back to the group that failed it: a requeue into a
// group no longer bound says so, as the CLI does.
func TestRequeueIntoAnUnboundGroupSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, "orders", "billing"))
	b.deadLetters(t, "orders", "billing", "rejected", 1, "boom") // 1000
	b.deadLetters(t, "orders", "gone", "rejected", 1, "boom")    // 1001: its group was unbound since
	done := b.act(t, url.Values{"action": {"requeue"}, "id": {"1000"}, "return": {"/ops/outbox/dead-letters"}}, 1)
	require.Contains(t, done, "Requeued 1 dead letter.")
	require.NotContains(t, done, "not bound to their topic")
	done = b.act(t, url.Values{"action": {"requeue-matching"}, "topic": {"orders"}, "return": {"/ops/outbox/dead-letters"}}, 1)
	require.Contains(t, done, "Requeued 1 dead letter. Rows wait in groups not bound to their topic")
	require.Contains(t, done, "group gone of &#34;orders&#34;.")
}

// A dead letter whose dedup key a message in the outbox holds stays where
// it is: the page says why, and the letter's own page stays in view.
func TestRequeueOfADeadLetterWhoseDedupKeyIsTakenSaysWhy(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "orders", "", "rejected", 2, "boom") // 1000..1001
	ctx := context.Background()
	_, err := b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET dedup_key = 'order-' || id`, b.env.Schema, b.env.Tables.DeadLetterTable))
	require.NoError(t, err)
	pub, err := pgoutbox.NewPublisher(b.exec(), pgoutbox.PublisherConfig{Tables: b.env.Tables}, nil)
	require.NoError(t, err)
	for _, key := range []string{"order-1000", "order-1001"} {
		m := msg("newer")
		pgoutbox.WithDedupKey(m, key)
		require.NoError(t, pub.Publish("orders", m))
	}

	done := b.act(t, url.Values{"action": {"requeue"}, "id": {"1000"}, "return": {"/ops/outbox/dead-letter?id=1000"}}, 1)
	require.Contains(t, done, "Requeued 0 dead letters. 1 dead letter stayed: a message in the outbox holds the dedup key")
	require.Contains(t, done, `id="requeue-one"`, "back on the letter's own page")
	done = b.act(t, url.Values{"action": {"requeue-matching"}, "topic": {"orders"}, "return": {"/ops/outbox/dead-letters"}}, 2)
	require.Contains(t, done, "Requeued 0 dead letters. 2 dead letters stayed")
	require.Equal(t, 2, b.dlqCount(t))
}

// A UI whose tables name a dead-letter table the outbox was made without
// says how to open it (the page failed with the server's error alone).
func TestDeadLettersOfAnOutboxWithoutThemSayWhatToDo(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{NoDeadLetterTable: true})
	tables := env.Tables
	tables.NoDeadLetterTable, tables.DeadLetterTable = false, ""
	ui, err := pgoutboxui.New(env.Exec(), tables, pgoutboxui.Options{BasePath: "/ops/outbox/"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ui.Close() })
	rec := httptest.NewRecorder()
	ui.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ops/outbox/dead-letters", nil))
	require.Contains(t, rec.Body.String(), "--no-dlq", "status %d", rec.Code)
}

// The confirmation of a delete by id says what will be deleted: an id
// given twice is one dead letter, an id that is none is said to be none,
// and the topics are named.
func TestConfirmationOfSelectedDeadLettersSaysWhich(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "orders", "", "rejected", 2, "x") // 1000..1001
	form := url.Values{"action": {"delete"}, "id": {"1000", "1000", "999999", "1001"}, "return": {"/ops/outbox/dead-letters"}, "csrf": {b.csrf(t)}}
	resp, body := b.post(t, "confirm", form)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	require.Contains(t, html.UnescapeString(body), `Delete 2 selected dead letters of 1 topic ("orders") for good: nobody will ever process them. 1 id of the selection is no dead letter now.`)
}

// A topic may begin or end with a space: "requeue all matching" acts on
// that topic, not on the one without the spaces.
func TestRequeueMatchingKeepsTheTopicAsGiven(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "sp", "", "rejected", 2, "x")   // 1000..1001
	b.deadLetters(t, " sp ", "", "rejected", 3, "y") // 1002..1004
	done := b.act(t, url.Values{"action": {"requeue-matching"}, "topic": {" sp "}, "reason": {"rejected"},
		"return": {"/ops/outbox/dead-letters"}}, 3)
	require.Contains(t, done, "Requeued 3 dead letters.")
	require.Equal(t, 2, b.dlqCount(t), `the dead letters of "sp" stay`)
	code, _ := b.get(t, "dead-letters?reason=%00")
	require.Equal(t, http.StatusBadRequest, code, "a reason that cannot be one is refused, not a server error")
	code, body := b.get(t, "dead-letter?id=abc")
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, body, "dead-letter id &#34;abc&#34; is not one", "an id given that is not one is not \"no id given\"")
}

// Delete one dead letter, then purge those older than an age.
func TestDeleteAndPurge(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "t", "", "rejected", 10, "boom") // failed 1..10 minutes ago
	done := b.act(t, url.Values{"action": {"delete"}, "id": {"1000"}, "return": {"/ops/outbox/dead-letter?id=1000"}}, 1)
	require.Contains(t, done, "Deleted 1 dead letter.")
	require.Equal(t, 9, b.dlqCount(t))
	code, _ := b.get(t, "dead-letter?id=1000")
	require.Equal(t, http.StatusNotFound, code)

	done = b.act(t, url.Values{"action": {"purge"}, "older_than": {"5m30s"}, "return": {"/ops/outbox/dead-letters"}}, 5)
	require.Contains(t, done, "Purged 5 dead letters.")
	require.Equal(t, 4, b.dlqCount(t))
}

// Pause and resume a group from its page; the confirmation counts the
// rows that will wait.
func TestPauseResume(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, "orders", "billing"))
	publish(t, b, "orders", msg("1"), msg("2"))
	page := b.page(t, "group?topic=orders&group=billing")
	require.Contains(t, page, `id="pause-button"`)
	done := b.act(t, url.Values{"action": {"pause"}, "topic": {"orders"}, "group": {"billing"}, "return": {"/ops/outbox/group?topic=orders&group=billing"}}, 2)
	require.Contains(t, done, `id="paused-badge"`)
	require.Contains(t, done, `id="resume-button"`)
	paused, err := pgoutbox.PausedGroups(ctx, b.exec(), b.env.Tables, "orders")
	require.NoError(t, err)
	require.Len(t, paused, 1)

	done = b.act(t, url.Values{"action": {"resume"}, "topic": {"orders"}, "group": {"billing"}, "return": {"/ops/outbox/group?topic=orders&group=billing"}}, 2)
	require.Contains(t, done, "Resumed group billing")
	require.NotContains(t, done, `id="paused-badge"`)
	paused, err = pgoutbox.PausedGroups(ctx, b.exec(), b.env.Tables, "orders")
	require.NoError(t, err)
	require.Empty(t, paused)
}

// Topic, group, payload, metadata and error shaped like HTML and script
// come out escaped on every page: nothing of them is markup.
func TestEscaping(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	ctx := context.Background()
	evil := `<script>alert("x")</script><img src=x onerror=alert(1)>`
	topic, group := "t"+evil, "g"+evil
	require.NoError(t, pgoutbox.Bind(ctx, b.exec(), b.env.Tables, topic, group))
	m := msg(evil)
	m.Metadata.Set(evil, evil)
	pgoutbox.WithOrderingKey(m, evil)
	publish(t, b, topic, m)
	_, err := b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET last_error = $1, deliveries = 5`, b.env.Schema, b.env.Tables.Table), evil)
	require.NoError(t, err)
	b.deadLetters(t, topic, group, evil, 1, evil)
	_, err = b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET metadata = jsonb_build_object($1::text, $1::text)`, b.env.Schema, b.env.Tables.DeadLetterTable), evil)
	require.NoError(t, err)

	groupPath := "group?" + url.Values{"topic": {topic}, "group": {group}}.Encode()
	var overview string
	require.Eventually(t, func() bool {
		overview = b.page(t, "")
		return strings.Contains(overview, "data-topic=")
	}, 10*time.Second, 50*time.Millisecond)
	pages := map[string]string{"overview": overview, "group": b.page(t, groupPath),
		"dead letters": b.page(t, "dead-letters"), "dead letter": b.page(t, "dead-letter?id=1000"),
		"dead letters filtered": b.page(t, "dead-letters?"+url.Values{"topic": {topic}, "reason": {"rejected"}}.Encode())}
	code, badReason := b.get(t, "dead-letters?"+url.Values{"topic": {topic}, "reason": {evil}}.Encode())
	require.Equal(t, http.StatusBadRequest, code, "not a failure reason")
	pages["bad reason"] = badReason
	form := url.Values{"action": {"pause"}, "topic": {topic}, "group": {group}, "csrf": {b.csrf(t)}}
	resp, confirm := b.post(t, "confirm", form)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	pages["confirm"] = confirm
	code, errPage := b.get(t, "dead-letter?id="+url.QueryEscape(evil))
	require.Equal(t, http.StatusBadRequest, code)
	pages["error"] = errPage
	for name, body := range pages {
		require.NotContains(t, body, "<script>alert", name)
		require.NotContains(t, body, "<img src=x", name)
		require.NotContains(t, body, "onerror=alert(1)>", name)
		// The one script is the page's own.
		require.Equal(t, 1, strings.Count(body, "<script"), name)
	}
	require.Contains(t, pages["group"], "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;", "the payload is shown, escaped")
	require.Contains(t, pages["dead letter"], "&lt;img src=x onerror=alert(1)&gt;", "the error is shown, escaped")
	require.Contains(t, overview, "t&lt;script&gt;")
	resp, err = b.client.Get(b.base)
	require.NoError(t, err)
	resp.Body.Close()
	require.Contains(t, resp.Header.Get("Content-Security-Policy"), "script-src 'self'", "no inline script would run anyway")
}

// The group page shows pending messages with their fields, payloads by
// kind, and an ordering key blocked by a head delivered many times.
func TestGroupPage(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	ctx := context.Background()
	head := msg(`{"a":1,"b":[1,2]}`)
	pgoutbox.WithOrderingKey(head, "customer-7")
	behind := msg("second")
	pgoutbox.WithOrderingKey(behind, "customer-7")
	bin := message.NewMessage(watermill.NewUUID(), []byte{0, 1, 2, 0xff})
	publish(t, b, "t", head, behind, bin)
	_, err := b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET deliveries = 6, last_error = 'card declined' WHERE uuid = $1`, b.env.Schema, b.env.Tables.Table), head.UUID)
	require.NoError(t, err)

	body := b.page(t, "group?topic=t&group=")
	require.Contains(t, body, "customer-7")
	require.Contains(t, body, "card declined")
	require.Contains(t, body, "{\n  &#34;a&#34;: 1,", "JSON is pretty-printed")
	require.Contains(t, body, "00000000  00 01 02 ff", "binary is shown as hex")
	require.Contains(t, body, "AAEC/w==", "and base64")
	blocked := regexp.MustCompile(`(?s)<table class="list" id="blocked">.*?</table>`).FindString(body)
	require.Contains(t, blocked, "customer-7")
	require.Contains(t, blocked, `<td class="n">6</td>`)
	require.Contains(t, blocked, `<td class="n">1</td>`, "one row waits behind the head")
}

// aheadClock is an executor whose database clock runs ten minutes ahead of
// this machine's: a server's clock cannot be moved from a test, so only
// the one statement that reads it is changed.
type aheadClock struct{ tx.Executor }

func (a aheadClock) Query(ctx context.Context, sql string, args ...any) (tx.Rows, error) {
	if sql == "SELECT clock_timestamp()" {
		sql = "SELECT clock_timestamp() + interval '10 minutes'"
	}
	return a.Executor.Query(ctx, sql, args...)
}

// A row is ready or scheduled by the database's clock, which wrote its
// due time, not by this machine's: with the server's clock ahead, a row
// due five minutes ago by it is ready (this machine's clock said
// "scheduled in 5m" of a row any subscriber would take at once).
func TestGroupPageTellsReadyRowsByTheDatabasesClock(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	ui, err := pgoutboxui.New(aheadClock{b.env.Exec()}, b.env.Tables, pgoutboxui.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ui.Close() })
	m := msg("due by the server")
	publish(t, b, "t", m)
	_, err = b.env.Pool.Exec(context.Background(), fmt.Sprintf(`UPDATE %s.%s SET available_at = now() + interval '5 minutes' WHERE uuid = $1`, b.env.Schema, b.env.Tables.Table), m.UUID)
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	ui.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/group?topic=t&group=", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	require.Regexp(t, `<span class="badge ready">ready</span> <span class="due">5m0[0-9]s ago</span>`, rec.Body.String())
	require.NotContains(t, rec.Body.String(), "scheduled in")
}

// Dead letters come in keyset pages of 50 and filter by reason and group.
func TestDeadLetterPages(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	b.deadLetters(t, "t", "a", "rejected", 60, "boom")
	b.deadLetters(t, "t", "b", "poisoned", 3, "bad")
	first := b.page(t, "dead-letters?topic=t&gmode=is&group=a")
	require.Equal(t, 50, strings.Count(first, `class="dl-link"`))
	next := regexp.MustCompile(`<a href="/ops/outbox/([^"]+)" id="next-page">`).FindStringSubmatch(first)
	require.NotNil(t, next)
	second := b.page(t, html.UnescapeString(next[1]))
	require.Equal(t, 10, strings.Count(second, `class="dl-link"`))
	require.NotContains(t, second, `id="next-page"`)
	poisoned := b.page(t, "dead-letters?reason=poisoned")
	require.Equal(t, 3, strings.Count(poisoned, `class="dl-link"`))
	code, _ := b.get(t, "dead-letters?after=yesterday")
	require.Equal(t, http.StatusBadRequest, code)
}

// A group filter with a mode other than "any" or "is" (a crafted or stale
// form, a hand-written URL) was dropped silently, and "requeue all
// matching" offered every dead letter; it is refused, as a bad reason is
// (which the confirmation offered to requeue too, as "0 rows").
func TestUnknownGroupModeIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "t", "billing", "rejected", 2, "x")
	b.deadLetters(t, "t", "shipping", "rejected", 3, "y")
	resp, body := b.post(t, "confirm", url.Values{"csrf": {b.csrf(t)}, "action": {"requeue-matching"},
		"gmode": {"iss"}, "group": {"billing"}, "return": {"/ops/outbox/dead-letters"}})
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "the confirmation offers: %s", body)
	resp, body = b.post(t, "confirm", url.Values{"csrf": {b.csrf(t)}, "action": {"requeue-matching"},
		"reason": {"bogus"}, "return": {"/ops/outbox/dead-letters"}})
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "a reason no dead letter can have: the confirmation offers: %s", body)
	require.Contains(t, body, "is not a failure reason")
}

// The purge confirmation for an age of 0 (every dead letter) read "failed
// more than - ago".
func TestPurgeOfEveryDeadLetterSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t, true)
	b.deadLetters(t, "t", "", "rejected", 2, "x")
	resp, body := b.post(t, "confirm", url.Values{"csrf": {b.csrf(t)}, "action": {"purge"}, "older_than": {"0"},
		"return": {"/ops/outbox/dead-letters"}})
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	require.NotContains(t, body, "more than - ago")
}

// The page of an outbox that does not exist (a mistyped --schema or
// --table) told the operator to set NoDeadLetterTable on the dead-letter
// page and gave the bare SQL error on the group page; both say to check
// the names or create the tables.
func TestMissingOutboxSaysCheckTheNames(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	ui, err := pgoutboxui.New(b.env.Exec(), schema.Config{Schema: "no_such_schema"}, pgoutboxui.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ui.Close() })
	for _, path := range []string{"/dead-letters", "/group?topic=orders&group=billing"} {
		rec := httptest.NewRecorder()
		ui.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		body := rec.Body.String()
		require.NotContains(t, body, "NoDeadLetterTable", path)
		require.Regexp(t, `schema apply|check the schema|--schema`, body, path)
		require.LessOrEqual(t, strings.Count(body, "schema apply"), 1, "the advice once: %s", path)
	}
	// The overview reads Stats, whose error says how to create the tables.
	rec := httptest.NewRecorder()
	ui.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	require.Equal(t, 1, strings.Count(rec.Body.String(), "schema apply"), "the advice once: %s", rec.Body.String())
}

// The pages with many rows read the start of each payload: a large
// message's preview and view are its start, with its whole size, and a
// text payload cut inside a character stays text; the dead letter's own
// page shows it whole.
func TestPagesShowLargePayloadsFromTheirStart(t *testing.T) {
	t.Parallel()
	b := setup(t, false)
	ctx := context.Background()
	text := "héllo " + strings.Repeat("é", 100_000) // past the 64 KiB a row reads
	binary := bytes.Repeat([]byte{0xff, 0x00}, 100_000)
	publish(t, b, "big", msg(text), message.NewMessage(watermill.NewUUID(), binary))
	body := b.page(t, "group?topic=big&group=")
	require.Contains(t, body, "héllo éééé")
	require.Contains(t, body, fmt.Sprintf("(cut: %d bytes in all)", len(text)))
	require.Contains(t, body, fmt.Sprintf("(%d bytes of binary)", len(binary)))
	require.Contains(t, body, fmt.Sprintf("(cut: %d bytes in all)", len(binary)))

	b.deadLetters(t, "big", "", "rejected", 1, "boom")
	_, err := b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET payload = $1`, b.env.Schema, b.env.Tables.DeadLetterTable), []byte(text))
	require.NoError(t, err)
	list := b.page(t, "dead-letters?topic=big")
	require.Contains(t, list, "héllo éééé", "the preview of a payload read by its first KiB")
	link := regexp.MustCompile(`href="/ops/outbox/(dead-letter\?id=\d+)"`).FindStringSubmatch(list)
	require.NotNil(t, link, list)
	one := b.page(t, html.UnescapeString(link[1]))
	require.Contains(t, one, fmt.Sprintf("(cut: %d bytes in all)", len(text)), "shown up to 64 KiB")
	require.Contains(t, one, strings.Repeat("é", 30_000), "read whole, shown from its start")
}

// Behind an exclusive lock on the outbox a page gives up after
// PageTimeout and says what may hold it, where it waited for as long as
// the lock was held, holding one of the pool's connections; the dead
// letters, another table, still answer.
func TestPagesBehindAnExclusiveLockGiveUpAndSayWhy(t *testing.T) {
	t.Parallel()
	b := setupWith(t, pgoutboxui.Options{PageTimeout: 500 * time.Millisecond})
	publish(t, b, "t", msg("a"))
	b.deadLetters(t, "t", "", "rejected", 1, "boom")
	b.env.LockOutbox(t)

	for range 3 { // more than the pool's connections would have stuck
		code, body := b.get(t, "group?topic=t&group=")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Contains(t, body, "no answer within 500ms: a session may hold or await an exclusive lock on the outbox")
	}
	require.Contains(t, b.page(t, "dead-letters?topic=t"), "boom")

	// The overview answers from the last sample, and says why the next
	// ones fail (its sampler gives up after 5 s).
	var overview string
	require.Eventually(t, func() bool {
		overview = b.page(t, "")
		return strings.Contains(overview, "Last sample failed")
	}, 20*time.Second, 100*time.Millisecond)
	require.Contains(t, overview, "a session may hold or await an exclusive lock on the outbox", overview)
	require.NotContains(t, overview, "took 5.", "the time beside the last sample is that sample's")
}
