package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	_ "time/tzdata" // the zones of TestListTimesReadBackAcrossSummerTime, on any machine

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// binary is the pgoutbox command built once by TestMain.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pgoutbox-cli-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "pgoutbox")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build pgoutbox: %v\n%s", err, out)
		os.Exit(1)
	}
	code := pgoutboxtest.Run(m)
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// cliRun runs the binary with the test outbox's connection flags and
// returns stdout, stderr and the exit code. stdin is empty (not a
// terminal).
func cliRun(t *testing.T, env *pgoutboxtest.Env, args ...string) (string, string, int) {
	t.Helper()
	if env != nil {
		args = append(args, "--dsn", env.DSN, "--schema", env.Schema)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = cliEnv()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("run pgoutbox %s: %v", strings.Join(args, " "), err)
	}
	return stdout.String(), stderr.String(), code
}

// cliEnv is the environment without the variables the CLI reads, so the
// tests' flags decide.
func cliEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PGOUTBOX_") || strings.HasPrefix(kv, "POSTGRES_DSN=") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

func publish(t *testing.T, env *pgoutboxtest.Env, topic string, payloads ...string) {
	t.Helper()
	for _, p := range payloads {
		require.NoError(t, env.Publisher.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(p))))
	}
}

func TestStatsJSON(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a", "b", "c")
	publish(t, env, "invoices", "x")
	out, errOut, code := cliRun(t, env, "stats", "--json")
	require.Equal(t, 0, code, errOut)
	var stats []statsJSON
	require.NoError(t, json.Unmarshal([]byte(out), &stats), out)
	got := map[string]int64{}
	for _, s := range stats {
		got[s.Topic] = s.Ready
	}
	require.Equal(t, map[string]int64{"orders": 3, "invoices": 1}, got)

	out, errOut, code = cliRun(t, env, "stats", "--topic", "orders", "--group", "", "--json")
	require.Equal(t, 0, code, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), &stats), out)
	require.Len(t, stats, 1)
	require.Equal(t, int64(3), stats[0].Ready)

	out, errOut, code = cliRun(t, env, "stats")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "orders")
}

// deadLetter publishes a message to topic and has the subscriber reject
// it, so it lands in the dead-letter table.
func deadLetter(t *testing.T, env *pgoutboxtest.Env, topic, payload string) {
	t.Helper()
	rejectInto(t, env, topic, func() { publish(t, env, topic, payload) })
}

// rejectInto subscribes to topic, runs publish, rejects the next message
// and waits for its dead letter, the topic's only one.
func rejectInto(t *testing.T, env *pgoutboxtest.Env, topic string, publish func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := env.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	publish()
	rejectNext(t, msgs)
	require.Eventually(t, func() bool {
		page, err := pgoutbox.DeadLetters(context.Background(), env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: topic})
		return err == nil && len(page.Letters) == 1
	}, 10*time.Second, 20*time.Millisecond)
}

// peekJSON runs pgoutbox peek --json with args and returns its messages.
func peekJSON(t *testing.T, env *pgoutboxtest.Env, args ...string) []pendingJSON {
	t.Helper()
	out, errOut, code := cliRun(t, env, append([]string{"peek", "--json"}, args...)...)
	require.Equal(t, 0, code, errOut)
	var peek struct {
		Messages []pendingJSON `json:"messages"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &peek), out)
	return peek.Messages
}

func TestDLQListShowRequeue(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", `{"id":42}`)

	out, errOut, code := cliRun(t, env, "dlq", "list", "--json")
	require.Equal(t, 0, code, errOut)
	var list struct {
		DeadLetters []deadLetterJSON `json:"dead_letters"`
		More        bool             `json:"more"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	require.Len(t, list.DeadLetters, 1)
	d := list.DeadLetters[0]
	require.Equal(t, "orders", d.Topic)
	require.Equal(t, "rejected", d.FailureReason)
	require.NotNil(t, d.Payload)
	require.Equal(t, `{"id":42}`, *d.Payload)
	id := fmt.Sprint(d.ID)

	out, errOut, code = cliRun(t, env, "dlq", "show", id)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `{"id":42}`)

	// Without a terminal and without --yes: refused, nothing moved.
	_, errOut, code = cliRun(t, env, "dlq", "requeue", "--id", id)
	require.Equal(t, exitRefused, code)
	require.Contains(t, errOut, "--yes")

	out, errOut, code = cliRun(t, env, "dlq", "requeue", "--id", id, "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 1")

	msgs, err := env.Subscriber.Subscribe(t.Context(), "orders")
	require.NoError(t, err)
	got := pgoutboxtest.Collect(t, msgs, 1, 10*time.Second) // acks it
	require.Equal(t, `{"id":42}`, string(got[0].Payload))

	_, errOut, code = cliRun(t, env, "dlq", "show", id)
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "no dead letter with id")
}

// A filtered requeue that matches nothing names what the dead-letter
// table holds, so a mistyped topic or group does not pass for "nothing to
// do"; a filter that matches dead letters says nothing more.
func TestDLQRequeueOfAMistypedTopicNamesTheTopicsHeld(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders.placed", `{"id":1}`)

	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--topic", "order.placed", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 0")
	require.Contains(t, errOut, `pgoutbox: note: no dead letter has topic "order.placed"`)
	require.Contains(t, errOut, `topic "orders.placed" group (default) (1)`)
	require.NotContains(t, out, "note:", "stdout holds what was done")

	_, errOut, code = cliRun(t, env, "dlq", "requeue", "--topic", "orders.placed", "--group", "billing", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, errOut, `no dead letter has group billing on topic "orders.placed"`)

	out, errOut, code = cliRun(t, env, "dlq", "requeue", "--topic", "orders.placed", "--reason", "max_deliveries", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 0")
	require.NotContains(t, errOut, "no dead letter has", "the topic holds dead letters; the reason left them out")

	out, errOut, code = cliRun(t, env, "dlq", "requeue", "--topic", "orders.placed", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 1")
	require.NotContains(t, errOut, "no dead letter has")
}

// A message dead-lettered at MaxDeliveries without an error had no
// delivery that ended with one: the tables say what that likely means
// instead of a blank.
func TestDLQShowsWhyAMaxDeliveriesLetterHasNoError(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", `{"id":7}`)
	_, err := env.Pool.Exec(context.Background(), `UPDATE `+env.Schema+`.outbox SET deliveries = 2`) // two crashes
	require.NoError(t, err)
	sub, err := pgoutbox.NewSubscriber(env.Pool, pgoutbox.SubscriberConfig{Tables: env.Tables, MaxDeliveries: 2}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(t.Context(), "orders")
	require.NoError(t, err)
	var page pgoutbox.DeadLetterPage
	require.Eventually(t, func() bool {
		page, err = pgoutbox.DeadLetters(context.Background(), env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: "orders"})
		return err == nil && len(page.Letters) == 1
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, pgoutbox.ReasonMaxDeliveries, page.Letters[0].FailureReason)
	require.Empty(t, page.Letters[0].LastError)

	out, errOut, code := cliRun(t, env, "dlq", "show", fmt.Sprint(page.Letters[0].ID))
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "Last error:   (none recorded: the handler may crash its process, outlive its Lease, or nack without an error)")
	out, errOut, code = cliRun(t, env, "dlq", "list")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "(none recorded: the handler may crash")
}

// The lists print local times with their zone, each its own (a time from
// the other side of a summer-time change has another offset), and --since
// and --until take a time as they print it (they took only RFC 3339 or a
// date).
func TestDLQListTimesNameTheirZoneAndAreTakenBySince(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", `{"id":9}`)
	out, errOut, code := cliRun(t, env, "dlq", "list")
	require.Equal(t, 0, code, errOut)
	printed := regexp.MustCompile(`\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+`).FindString(out)
	require.NotEmpty(t, printed, out)
	var list struct {
		DeadLetters []deadLetterJSON `json:"dead_letters"`
	}
	for _, since := range []string{printed, printed[:len(time.DateTime)]} {
		out, errOut, code = cliRun(t, env, "dlq", "list", "--since", since, "--json")
		require.Equal(t, 0, code, errOut)
		require.NoError(t, json.Unmarshal([]byte(out), &list), out)
		require.Len(t, list.DeadLetters, 1, "the letter failed within the second printed (%s)", since)
	}
	at, err := time.ParseInLocation(listTimeLayout, printed, time.Local)
	require.NoError(t, err)
	out, errOut, code = cliRun(t, env, "dlq", "list", "--until", listTime(at.Add(-time.Second)), "--json")
	require.Equal(t, 0, code, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	require.Empty(t, list.DeadLetters, "none failed before that second")

	publish(t, env, "invoices", `{"id":10}`)
	out, errOut, code = cliRun(t, env, "peek", "--topic", "invoices")
	require.Equal(t, 0, code, errOut)
	require.Regexp(t, `\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+`, out)
}

// A time is printed with the abbreviation of its own offset, and read back
// to the same instant, in zones with summer time, without abbreviations,
// and at a half hour.
func TestListTimesReadBackAcrossSummerTime(t *testing.T) {
	for _, zone := range []string{"Europe/Berlin", "Asia/Dubai", "America/St_Johns", "UTC"} {
		loc, err := time.LoadLocation(zone)
		require.NoError(t, err)
		for _, at := range []time.Time{time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC), time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)} {
			s := at.In(loc).Format(listTimeLayout)
			back, err := time.ParseInLocation(listTimeLayout, s, loc)
			require.NoError(t, err)
			require.True(t, back.Equal(at), "%s: %s read back as %s", zone, s, back)
		}
	}
}

func TestDLQPurge(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", "x")
	_, errOut, code := cliRun(t, env, "dlq", "purge", "--older-than", "0")
	require.Equal(t, exitRefused, code, errOut)
	out, errOut, code := cliRun(t, env, "dlq", "purge", "--older-than", "1h", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "purged 0")
	out, errOut, code = cliRun(t, env, "dlq", "purge", "--older-than", "30d", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "purged 0", "days, as the operator page takes them")
	_, errOut, code = cliRun(t, env, "dlq", "purge", "--older-than", "a month", "--yes")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "30d, 720h or 90m")
	out, errOut, code = cliRun(t, env, "dlq", "purge", "--older-than", "0", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "purged 1")
}

func TestPublishPeek(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	out, errOut, code := cliRun(t, env, "publish", "--topic", "orders", "--payload", `{"id":7}`,
		"--metadata", "source=cli", "--metadata", "k=v=w", "--dedup-key", "order-7", "--json")
	require.Equal(t, 0, code, errOut)
	var pub struct {
		UUID    string `json:"uuid"`
		Skipped bool   `json:"skipped"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &pub), out)
	require.False(t, pub.Skipped)

	peeked := peekJSON(t, env, "--topic", "orders")
	require.Len(t, peeked, 1)
	m := peeked[0]
	require.Equal(t, pub.UUID, m.UUID)
	require.Equal(t, `{"id":7}`, *m.Payload)
	require.Equal(t, "cli", m.Metadata["source"])
	require.Equal(t, "v=w", m.Metadata["k"])
	require.Equal(t, "order-7", m.DedupKey)

	// The same dedup key again is skipped.
	out, errOut, code = cliRun(t, env, "publish", "--topic", "orders", "--payload", "again", "--dedup-key", "order-7")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "skipped")
}

// TestPublishGoesToTheOutbox: every outbox has an arrivals table, and
// finding one says nothing of its subscribers: pgoutbox publish writes
// into the outbox, which every subscriber reads.
func TestPublishGoesToTheOutbox(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	count := func(table string) int {
		var n int
		require.NoError(t, env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+env.Schema+`".`+table+` WHERE topic = 'plain'`).Scan(&n))
		return n
	}
	for _, args := range [][]string{{}, {"--arrivals"}} {
		_, errOut, code := cliRun(t, env, append([]string{"publish", "--topic", "plain", "--payload", "x"}, args...)...)
		require.Equal(t, 0, code, errOut)
	}
	require.Equal(t, 2, count("outbox"))
	require.Zero(t, count("outbox_arrivals"))
}

func TestSchemaValidate(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	out, errOut, code := cliRun(t, env, "schema", "validate", "--json")
	require.Equal(t, 0, code, errOut)
	require.JSONEq(t, `{"ok":true,"problems":[]}`, out)

	out, _, code = cliRun(t, env, "schema", "validate", "--table", "missing_outbox")
	require.Equal(t, exitValidation, code)
	require.Contains(t, out, "missing_outbox is missing")
}

func TestSchemaSQLAndApply(t *testing.T) {
	t.Parallel()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	out, errOut, code := cliRun(t, nil, "schema", "sql", "--schema", s.Name)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "CREATE TABLE")
	args := []string{"--dsn", s.DSN, "--schema", s.Name}
	_, _, code = cliRun(t, nil, append([]string{"schema", "validate"}, args...)...)
	require.Equal(t, exitValidation, code)
	_, errOut, code = cliRun(t, nil, append([]string{"schema", "apply"}, args...)...)
	require.Equal(t, 0, code, errOut)
	_, errOut, code = cliRun(t, nil, append([]string{"schema", "validate"}, args...)...)
	require.Equal(t, 0, code, errOut)
}

func TestBindUnbind(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)
	publish(t, env, "orders", "a")
	out, errOut, code := cliRun(t, env, "peek", "--topic", "orders", "--group", "billing", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"payload": "a"`)
	// A mistyped group is not taken for a drained one.
	out, errOut, code = cliRun(t, env, "peek", "--topic", "orders", "--group", "biling")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "no pending messages")
	require.Contains(t, errOut, "group biling is not bound to topic \"orders\" (mistyped?)")

	_, _, code = cliRun(t, env, "unbind", "--topic", "orders", "--group", "billing", "--purge")
	require.Equal(t, exitRefused, code)
	out, errOut, code = cliRun(t, env, "unbind", "--topic", "orders", "--group", "billing", "--purge", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "deleted 1")
}

// A group whose name has spaces is quoted where the CLI prints it, so
// " ops team " and "ops team" read apart; plain names stay bare.
func TestGroupNamesWithSpacesArePrintedQuoted(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	out, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", " ops team ")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `bound group " ops team " to topic "orders"`)
	out, errOut, code = cliRun(t, env, "bind", "--topic", "orders", "--group", "ops team")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `bound group "ops team" to topic "orders"`)
	out, errOut, code = cliRun(t, env, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `bound group billing to topic "orders"`)

	out, errOut, code = cliRun(t, env, "stats", "--topic", "orders")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `" ops team "`)
	require.Contains(t, out, `"ops team"`)
	require.Regexp(t, `(?m)^orders\s+billing\s`, out)
}

// Names print bare when they read as themselves, quoted otherwise: the
// default group's "(default)" and a group named so read apart too.
func TestGroupNameReadsApart(t *testing.T) {
	for in, want := range map[string]string{
		"":                  "(default)",
		"(default)":         `"(default)"`,
		"billing":           "billing",
		"Zahlungsverkehr-Ü": "Zahlungsverkehr-Ü",
		" ops team ":        `" ops team "`,
		"ops team":          `"ops team"`,
		`say "hi"`:          `"say \"hi\""`,
		"tab\there":         `"tab\there"`,
		"bad\xffutf8":       `"bad\xffutf8"`,
	} {
		require.Equal(t, want, groupName(in), "%q", in)
	}
}

// bind names the publishes that outlasted its wait at a topic's first
// binding, and says how their messages reach the group (the binding
// itself: tests/TestBindNamesThePublishesStillOpenAcrossTheFirstBinding).
func TestBindWarnsOfPublishesStillOpen(t *testing.T) {
	var out bytes.Buffer
	printStillPublishing(&out, "orders placed", nil)
	require.Empty(t, out.String())
	printStillPublishing(&out, "orders placed", []string{"4/17", "5/2"})
	require.Contains(t, out.String(), "warning: 2 transaction(s) publishing to the outbox were still open")
	require.Contains(t, out.String(), "(virtual transaction ids 4/17, 5/2 in pg_locks, whose pid names each session in pg_stat_activity)")
	require.Contains(t, out.String(), "run pgoutbox bind --topic 'orders placed' again once they ended")
}

// Messages published while nothing consumed a topic: stats warns, bind
// says the new group got them; a group unbound with messages left is
// warned about, and move hands its messages on.
func TestBindStrandedAndMove(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "early")
	out, errOut, code := cliRun(t, env, "stats")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `warning: 1 message(s) of topic "orders" were published while nothing was bound to it`)
	out, errOut, code = cliRun(t, env, "stats", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"unbound": 1`)
	// An unbind --purge that forgot --group finds the default group
	// unbound: its rows are the unbound message, which stays.
	_, errOut, code = cliRun(t, env, "unbind", "--topic", "orders", "--purge", "--yes")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "nothing was unbound or deleted")
	out, _, _ = cliRun(t, env, "stats", "--json")
	require.Contains(t, out, `"unbound": 1`, "the message waits for the first group still")

	out, errOut, code = cliRun(t, env, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `bound group billing to topic "orders": it gets every message published from now on, and the earlier ones counted below`)
	require.Contains(t, out, "1 message(s) published while nothing consumed the topic went to the groups bound now")
	out, errOut, code = cliRun(t, env, "stats")
	require.Equal(t, 0, code, errOut)
	// (Other warnings may stand: the server's, such as autovacuum off.)
	require.NotContains(t, out, "were published while nothing was bound", "the bind took them")
	require.NotContains(t, out, "is not bound to topic")

	_, errOut, code = cliRun(t, env, "unbind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)
	out, errOut, code = cliRun(t, env, "bind", "--topic", "orders", "--group", "invoicing", "--from", "backlog")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `warning: group billing is not bound to topic "orders" and holds 1 message(s)`)
	require.Contains(t, out, "pgoutbox move --topic orders --from billing --to G")
	out, _, _ = cliRun(t, env, "stats")
	require.Contains(t, out, `warning: group billing is not bound to topic "orders" and holds 1 message(s)`)
	require.Regexp(t, `(?m)^orders +billing .* not bound *$`, out, "its STATE says nobody consumes it")
	require.Regexp(t, `(?m)^orders +invoicing .*[-0-9] +bound *$`, out, "a bound group's STATE says bound, not whether a subscriber runs")
	require.Contains(t, out, "a group that does not have them yet")
	require.Contains(t, out, "pgoutbox bind --topic orders --group billing (or a Subscribe of the group) if it is to consume them",
		"binding it again is one way: the warning says so")

	publish(t, env, "audit", "a")
	out, errOut, code = cliRun(t, env, "bind", "--topic", "audit", "--group", "")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "1 message(s) published while nothing was bound stay in the default group")
	require.Contains(t, out, "it gets every message published from now on, and the earlier ones counted below", "not only from now on")

	_, _, code = cliRun(t, env, "move", "--topic", "orders", "--from", "billing", "--to", "invoicing")
	require.Equal(t, exitRefused, code)
	out, errOut, code = cliRun(t, env, "move", "--topic", "orders", "--from", "billing", "--to", "invoicing", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "moved 1 message(s)")
	out, errOut, code = cliRun(t, env, "peek", "--topic", "orders", "--group", "invoicing", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"payload": "early"`)
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"nope"},
		{"stats", "--bogus"},
		{"stats", "--group", "g"},
		{"dlq"},
		{"dlq", "requeue"},
		{"dlq", "requeue", "--id", "x"},
		{"dlq", "purge"},
		{"dlq", "show"},
		{"peek"},
		{"publish", "--payload", "x"},
		{"schema", "drop"},
		{"bind", "--topic", "t", "--from", "earliest"},
		{"move", "--topic", "t", "--from", "a", "--to", "a"},
	} {
		_, errOut, code := cliRun(t, nil, args...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		require.NotEmpty(t, errOut)
	}
	// No database configured.
	_, errOut, code := cliRun(t, nil, "stats")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "PGOUTBOX_DSN")
	// Two layouts that exclude each other name the flags, not the names.
	_, errOut, code = cliRun(t, nil, "schema", "sql", "--rotating", "--arrivals")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "drop --arrivals")
	require.NotContains(t, errOut, "--table")
}

func TestHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--help"}, {"schema", "--help"}, {"schema", "sql", "--help"}, {"stats", "--help"}, {"dlq", "--help"},
		{"dlq", "list", "--help"}, {"dlq", "show", "-h"}, {"dlq", "requeue", "--help"}, {"dlq", "purge", "--help"},
		{"peek", "--help"}, {"publish", "--help"}, {"bind", "--help"}, {"unbind", "--help"}, {"move", "--help"},
		{"dlq", "delete", "--help"}, {"cancel", "--help"}, {"version", "--help"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(args, strings.NewReader(""), &stdout, &stderr)
		require.Equal(t, 0, code, "%v: %s", args, stderr.String())
		require.Contains(t, stdout.String(), "Exit codes", "%v", args)
	}
}

// TestConfirmTerminal answers the question on a pretend terminal (not
// parallel: it replaces isTerminal).
func TestConfirmTerminal(t *testing.T) {
	prev := isTerminal
	isTerminal = func(io.Reader) bool { return true }
	t.Cleanup(func() { isTerminal = prev })
	for answer, ok := range map[string]bool{"y\n": true, "yes\n": true, "n\n": false, "\n": false, "": false} {
		var stderr bytes.Buffer
		c := &cli{stdin: strings.NewReader(answer), stdout: io.Discard, stderr: &stderr}
		err := c.confirm("dlq purge", "Delete?", false)
		require.Equal(t, ok, err == nil, "answer %q: %v", answer, err)
		require.Contains(t, stderr.String(), "Delete? [y/N]")
		if !ok {
			require.ErrorIs(t, err, errRefused)
		}
	}
	// A refusal exits with 3 without touching the database.
	code := run([]string{"dlq", "purge", "--older-than", "0", "--dsn", "postgres://nobody@127.0.0.1:1/x"}, strings.NewReader("n\n"), io.Discard, io.Discard)
	require.Equal(t, exitRefused, code)
}

// TestRequeueParked: without a dead-letter table, dlq requeue makes parked
// rows due again.
func TestRequeueParked(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{NoDeadLetterTable: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := env.Subscriber.Subscribe(ctx, "orders")
	require.NoError(t, err)
	publish(t, env, "orders", "p")
	select {
	case m := <-msgs:
		_ = pgoutbox.Reject(m, "test rejection")
		m.Nack()
	case <-time.After(10 * time.Second):
		t.Fatal("no message to reject")
	}
	require.Eventually(t, func() bool {
		rows, err := pgoutbox.Peek(context.Background(), env.Exec(), env.Tables, "orders", "", 10)
		return err == nil && len(rows) == 1 && rows[0].Parked
	}, 10*time.Second, 20*time.Millisecond)

	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--no-dlq", "--topic", "orders", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 1")
	got := pgoutboxtest.Collect(t, msgs, 1, 10*time.Second) // acks it
	require.Equal(t, "p", string(got[0].Payload))
}

// An operator converts a single table with the CLI; afterwards every
// command knows the outbox rotates without being told, and a --rotating
// that contradicts the database is a usage error.
func TestSchemaConvertToRotating(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "conv", "kept")

	_, errOut, code := cliRun(t, env, "schema", "convert-to-rotating")
	require.Equal(t, exitRefused, code, "no terminal, no --yes: %s", errOut)
	require.Contains(t, errOut, "pass --yes")
	_, errOut, code = cliRun(t, env, "schema", "validate", "--rotating")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "is a single table, not a rotating outbox")

	out, errOut, code := cliRun(t, env, "schema", "convert-to-rotating", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "is a rotating outbox; its rows are in outbox_long")
	out, errOut, code = cliRun(t, env, "schema", "convert-to-rotating", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "a rotating outbox already")

	out, errOut, code = cliRun(t, env, "schema", "validate", "--json")
	require.Equal(t, 0, code, errOut)
	require.JSONEq(t, `{"ok":true,"problems":[]}`, out, "validated as the rotating outbox it is")
	_, errOut, code = cliRun(t, env, "schema", "validate", "--rotating=false")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "is a rotating outbox; drop --rotating=false")
	out, errOut, code = cliRun(t, env, "peek", "--topic", "conv", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "kept")

	out, errOut, code = cliRun(t, nil, "schema", "sql", "--rotating")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "PARTITION BY LIST (generation)")
}

// And back: the operator turns the rotating outbox into a single table,
// its message kept; the commands know it without being told.
func TestSchemaConvertToSingle(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true})
	publish(t, env, "back", "kept")

	_, errOut, code := cliRun(t, env, "schema", "convert-to-single")
	require.Equal(t, exitRefused, code, "no terminal, no --yes: %s", errOut)
	require.Contains(t, errOut, "pass --yes")
	out, errOut, code := cliRun(t, env, "schema", "convert-to-single", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "is a single table, with every row")
	out, errOut, code = cliRun(t, env, "schema", "convert-to-single", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "a single table already")

	out, errOut, code = cliRun(t, env, "schema", "validate", "--json")
	require.Equal(t, 0, code, errOut)
	require.JSONEq(t, `{"ok":true,"problems":[]}`, out, "validated as the single table it is")
	out, errOut, code = cliRun(t, env, "peek", "--topic", "back", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "kept")
}

// Connection flags work before the command as well as after it.
func TestConnectionFlagsBeforeTheCommand(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a", "b")
	out, errOut, code := cliRun(t, nil, "--dsn", env.DSN, "--schema="+env.Schema, "stats", "--json")
	require.Equal(t, 0, code, errOut)
	var stats []statsJSON
	require.NoError(t, json.Unmarshal([]byte(out), &stats), out)
	require.Len(t, stats, 1)
	require.Equal(t, int64(2), stats[0].Ready)

	_, errOut, code = cliRun(t, nil, "--dsn", env.DSN)
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "no command given")
}

func TestConnectionFlagsLast(t *testing.T) {
	for _, c := range []struct{ in, want []string }{
		{[]string{"stats"}, []string{"stats"}},
		{[]string{"--dsn", "D", "stats", "--json"}, []string{"stats", "--json", "--dsn", "D"}},
		{[]string{"-dsn=D", "--no-dlq", "--table", "T", "dlq", "show", "--id", "1"}, []string{"dlq", "show", "--id", "1", "-dsn=D", "--no-dlq", "--table", "T"}},
		{[]string{"--schema", "S", "publish", "--topic", "t", "--", "-x"}, []string{"publish", "--topic", "t", "--schema", "S", "--", "-x"}},
		{[]string{"--help"}, []string{"--help"}},
		{[]string{"--bogus", "stats"}, []string{"--bogus", "stats"}},
		{[]string{"--dsn", "D"}, nil},
		{[]string{"--rotating", "stats"}, []string{"stats", "--rotating"}},
		{[]string{"--rotating=false", "--arrivals", "--json", "--dsn", "D", "dlq", "list"}, []string{"dlq", "list", "--rotating=false", "--arrivals", "--json", "--dsn", "D"}},
		{[]string{"--rotating", "schema", "sql", "--", "x"}, []string{"schema", "sql", "--rotating", "--", "x"}},
	} {
		require.Equal(t, c.want, connectionFlagsLast(c.in), "%v", c.in)
	}
}

// Behind PgBouncer in transaction pooling mode without the simple protocol
// the CLI's second run meets the first one's prepared statements; its
// error names the setting (TestPgBouncerWithoutTheSimpleProtocolSaysSo
// runs it through a real PgBouncer for Subscribe).
func TestHintNamesPgBouncer(t *testing.T) {
	for _, code := range []string{"42P05", "26000"} {
		err := fmt.Errorf("stats: %w", &pgconn.PgError{Code: code, Message: `prepared statement "stmtcache_1"`})
		var stderr bytes.Buffer
		fmt.Fprintf(&stderr, "pgoutbox: %s%s\n", errorText(err), hint(err))
		require.Contains(t, stderr.String(), "default_query_exec_mode=simple_protocol", code)
		require.Equal(t, 1, strings.Count(stderr.String(), "simple_protocol"), "named once")
	}
	require.Empty(t, hint(errors.New("no server error")))
}

// A keyed message's ordering key shows in peek (a KEY column, and in
// --json) and in a dead letter's list and show: what an operator looks
// for when a key is blocked.
func TestPeekAndDLQShowTheOrderingKey(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "publish", "--topic", "orders", "--payload", "a", "--ordering-key", "customer-7")
	require.Equal(t, 0, code, errOut)
	out, errOut, code := cliRun(t, env, "peek", "--topic", "orders")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "KEY")
	require.Contains(t, out, "customer-7")
	peeked := peekJSON(t, env, "--topic", "orders")
	require.Len(t, peeked, 1)
	require.Equal(t, "customer-7", peeked[0].OrderingKey)

	rejectInto(t, env, "orders", func() {})
	out, errOut, code = cliRun(t, env, "dlq", "list", "--json")
	require.Equal(t, 0, code, errOut)
	var list struct {
		DeadLetters []deadLetterJSON `json:"dead_letters"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	require.Len(t, list.DeadLetters, 1)
	require.Equal(t, "customer-7", list.DeadLetters[0].OrderingKey)
	out, errOut, code = cliRun(t, env, "dlq", "show", fmt.Sprint(list.DeadLetters[0].ID))
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "Ordering key: customer-7")
}

// The peek table reads the start of each payload (it shows a line of it):
// a large text payload is still shown as text, cut inside a character or
// not, a binary one by its whole size, and --json still has them whole.
func TestPeekTableShowsLargePayloadsFromTheirStart(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	text := "héllo " + strings.Repeat("é", 100_000) // a cut at an odd byte splits a character
	binary := bytes.Repeat([]byte{0xff, 0x00}, 100_000)
	require.NoError(t, pub.Publish("big", message.NewMessage("text", []byte(text)), message.NewMessage("binary", binary)))
	out, errOut, code := cliRun(t, env, "peek", "--topic", "big")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "héllo éééé")
	require.Contains(t, out, fmt.Sprintf("(%d bytes)", len(binary)), "the whole size")
	peeked := peekJSON(t, env, "--topic", "big")
	require.Len(t, peeked, 2)
	require.Equal(t, text, *peeked[0].Payload)
	require.Equal(t, binary, peeked[1].PayloadBase64)
}
