package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// cliRunEnv is cliRun with variables added to the environment.
func cliRunEnv(t *testing.T, vars []string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(cliEnv(), vars...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return stdout.String(), stderr.String(), ee.ExitCode()
	}
	require.NoError(t, err)
	return stdout.String(), stderr.String(), 0
}

// rejectNext rejects the next message of msgs: a dead letter.
func rejectNext(t *testing.T, msgs <-chan *message.Message) {
	t.Helper()
	select {
	case m := <-msgs:
		_ = pgoutbox.Reject(m, "test rejection")
		m.Nack()
	case <-time.After(10 * time.Second):
		t.Fatal("no message to reject")
	}
}

// deadLetters rejects n messages published to topic, so that they land in
// the dead-letter table, and returns their ids in listing order.
func deadLetters(t *testing.T, env *pgoutboxtest.Env, topic string, n int) []int64 {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := env.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	for i := range n {
		publish(t, env, topic, fmt.Sprint(i))
	}
	for range n {
		rejectNext(t, msgs)
	}
	var ids []int64
	require.Eventually(t, func() bool {
		page, err := pgoutbox.DeadLetters(context.Background(), env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: topic})
		ids = ids[:0]
		for _, d := range page.Letters {
			ids = append(ids, d.ID)
		}
		return err == nil && len(ids) == n
	}, 10*time.Second, 20*time.Millisecond)
	return ids
}

func TestVersion(t *testing.T) {
	t.Parallel()
	out, errOut, code := cliRun(t, nil, "version")
	require.Equal(t, 0, code, errOut)
	// A build from a working tree has no module version ("(devel)"), or,
	// with VCS stamping (Go 1.24+, -buildvcs), a pseudo-version.
	want := debugVersion()
	require.Regexp(t, regexp.MustCompile(`^pgoutbox (\(devel\)|v[0-9]+\.[0-9]+\.[0-9]+\S*) \(go[0-9.]+.*\)\n$`), out)
	require.Contains(t, out, "pgoutbox "+want+" (")
	out, errOut, code = cliRun(t, nil, "--version", "--json")
	require.Equal(t, 0, code, errOut)
	var v map[string]string
	require.NoError(t, json.Unmarshal([]byte(out), &v), out)
	require.Equal(t, want, v["version"])
}

// A value the outbox refuses is a usage error (2), and every error names
// pgoutbox once.
func TestBadInputExitsTwo(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	for _, args := range [][]string{
		{"bind", "--topic", "a\x01b"},
		{"bind", "--topic", "orders", "--group", "g\x02"},
		{"peek", "--topic", "a\x01b"},
		{"dlq", "list", "--topic", "a\x01b"},
		{"publish", "--topic", "a\x01b", "--payload", "x"},
		{"stats", "--table", "bad name"},
	} {
		_, errOut, code := cliRun(t, env, args...)
		require.Equal(t, exitUsage, code, "%q: %s", args, errOut)
		require.Regexp(t, "control character|not a valid identifier", errOut, "%q", args)
		require.Equal(t, 1, strings.Count(errOut, "pgoutbox:"), "%q: %s", args, errOut)
	}

	_, errOut, code := cliRunEnv(t, []string{"PGOUTBOX_NO_DLQ=maybe"}, "stats", "--dsn", env.DSN, "--schema", env.Schema)
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, `PGOUTBOX_NO_DLQ="maybe" is not valid; use true or false`)
	_, errOut, code = cliRunEnv(t, []string{"PGOUTBOX_NO_DLQ=false"}, "stats", "--dsn", env.DSN, "--schema", env.Schema)
	require.Equal(t, 0, code, errOut)

	// A variable of the commands spelt otherwise is read by nobody: the
	// command would act on the default outbox. Nothing is published.
	for _, v := range []string{"pgoutbox_schema=" + env.Schema, "PGOUTBOX_DLQTABLE=dead", "Pgoutbox_Dsn=" + env.DSN} {
		_, errOut, code = cliRunEnv(t, []string{v}, "publish", "--topic", "misspelt", "--payload", "x", "--dsn", env.DSN, "--schema", env.Schema)
		require.Equal(t, exitUsage, code, "%s: %s", v, errOut)
		require.Contains(t, errOut, "is not read (a misspelling?); use PGOUTBOX_", v)
	}
	pgoutboxtest.RequireNotPublished(t, env.Exec(), "misspelt", pgoutboxtest.InTables(env.Tables))
	out, errOut, code := cliRunEnv(t, []string{"pgoutbox_schema=x"}, "version")
	require.Equal(t, 0, code, "a version for a bug report, whatever the variables hold: %s", errOut)
	require.Contains(t, out, "pgoutbox ")
	_, errOut, code = cliRun(t, nil, "stats", "--dsn", " ")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "--dsn is blank")
}

// A missing table says how to create it, with the prefix once.
func TestMissingTableHint(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	for _, args := range [][]string{
		{"stats", "--table", "missing_outbox"},
		{"dlq", "list", "--table", "missing_outbox"},
		{"peek", "--topic", "t", "--table", "missing_outbox"},
	} {
		_, errOut, code := cliRun(t, env, args...)
		require.Equal(t, exitError, code, "%q: %s", args, errOut)
		require.Contains(t, errOut, "pgoutbox schema apply", "%q", args)
		require.Contains(t, errOut, "--schema and --table", "%q", args)
		require.Equal(t, 1, strings.Count(errOut, "schema apply"), "one hint: %q: %s", args, errOut)
		require.Equal(t, 1, strings.Count(errOut, "pgoutbox:"), "%q: %s", args, errOut)
	}
}

func TestUnbindNotBound(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	out, errOut, code := cliRun(t, env, "unbind", "--topic", "orders", "--group", "never")
	require.Equal(t, exitError, code, out)
	require.Contains(t, errOut, `group never was not bound to topic "orders"; nothing was unbound`)
	require.NotContains(t, out, "unbound group")
}

// stats --watch into a pipe writes one table after another, without the
// escape codes that clear a terminal.
func TestStatsWatchIntoAPipe(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a")
	cmd := exec.Command(binary, "stats", "--watch", "--interval", "100ms", "--dsn", env.DSN, "--schema", env.Schema)
	cmd.Env = cliEnv()
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	var got strings.Builder
	sc := bufio.NewScanner(stdout)
	frames := 0
	for frames < 3 && sc.Scan() {
		got.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(sc.Text(), "pgoutbox stats ") {
			frames++
		}
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	require.NoError(t, cmd.Wait(), "Ctrl-C ends --watch with 0")
	require.Equal(t, 3, frames, got.String())
	require.NotContains(t, got.String(), "\033[", "no terminal codes in a pipe")
	require.Contains(t, got.String(), "orders")
}

func TestDLQPagingDeleteAndPurgeByTopic(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ids := deadLetters(t, env, "orders", 3)
	other := deadLetters(t, env, "invoices", 1)

	type listing struct {
		DeadLetters []deadLetterJSON `json:"dead_letters"`
		More        bool             `json:"more"`
		NextAfter   int64            `json:"next_after"`
	}
	list := func(args ...string) listing {
		t.Helper()
		out, errOut, code := cliRun(t, env, append([]string{"dlq", "list", "--json"}, args...)...)
		require.Equal(t, 0, code, errOut)
		var l listing
		require.NoError(t, json.Unmarshal([]byte(out), &l), out)
		return l
	}
	// Page through the topic one row at a time with --after.
	var seen []int64
	l := list("--topic", "orders", "--limit", "1")
	for {
		require.Len(t, l.DeadLetters, 1)
		seen = append(seen, l.DeadLetters[0].ID)
		if !l.More {
			break
		}
		require.Equal(t, l.DeadLetters[0].ID, l.NextAfter)
		l = list("--topic", "orders", "--limit", "1", "--after", fmt.Sprint(l.NextAfter))
	}
	require.Equal(t, ids, seen)
	out, errOut, code := cliRun(t, env, "dlq", "list", "--topic", "orders", "--limit", "2")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, fmt.Sprintf(`the next page is "pgoutbox dlq list --after %d"`, ids[1]))

	// --since and --until bound the failure time.
	require.Len(t, list("--since", "1h").DeadLetters, 4)
	require.Len(t, list("--until", "1h").DeadLetters, 0)
	require.Len(t, list("--since", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)).DeadLetters, 0)
	// Ages and dates as --older-than and an operator type them.
	require.Len(t, list("--since", "1d").DeadLetters, 4)
	require.Len(t, list("--since", time.Now().Add(48*time.Hour).Format(time.DateOnly)).DeadLetters, 0)
	require.Len(t, list("--until", time.Now().Add(48*time.Hour).Format(time.DateOnly)).DeadLetters, 4)
	_, errOut, code = cliRun(t, env, "dlq", "list", "--since", "yesterday")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "30d")

	// Delete one dead letter; deleting it again says it is gone.
	_, _, code = cliRun(t, env, "dlq", "delete", "--id", fmt.Sprint(ids[0]))
	require.Equal(t, exitRefused, code)
	out, errOut, code = cliRun(t, env, "dlq", "delete", "--id", fmt.Sprint(ids[0]), "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "deleted 1 dead letter(s)")
	_, errOut, code = cliRun(t, env, "dlq", "delete", "--id", fmt.Sprint(ids[0]), "--yes")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "1 of the ids were not dead letters")
	_, errOut, code = cliRun(t, env, "dlq", "show", fmt.Sprint(ids[0]))
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "no dead letter with id")
	out, errOut, code = cliRun(t, env, "dlq", "show", fmt.Sprint(ids[1]))
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "Topic:        orders")

	// Purge one topic's and group's dead letters: the other topic keeps its own.
	out, errOut, code = cliRun(t, env, "dlq", "purge", "--older-than", "0", "--topic", "orders", "--group", "", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "purged 2 dead letter(s)")
	rest := list()
	require.Len(t, rest.DeadLetters, 1)
	require.Equal(t, other[0], rest.DeadLetters[0].ID)
	out, errOut, code = cliRun(t, env, "dlq", "purge", "--older-than", "0", "--topic", "invoices", "--group", "billing", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "purged 0 dead letter(s)", "another group's dead letters stay")
}

func TestCancelByDedupKey(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "publish", "--topic", "reminders", "--payload", "x", "--delay", "1h", "--dedup-key", "order-42")
	require.Equal(t, 0, code, errOut)
	env.RequireScheduled(t, env.Exec(), "reminders", "order-42")

	out, errOut, code := cliRun(t, env, "cancel", "--topic", "reminders", "--dedup-key", "order-42")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `cancelled the message of "reminders" with dedup key "order-42"`)
	env.RequireNotPublished(t, env.Exec(), "reminders")

	out, errOut, code = cliRun(t, env, "cancel", "--topic", "reminders", "--dedup-key", "order-42", "--json")
	require.Equal(t, exitError, code, errOut)
	require.JSONEq(t, `{"topic":"reminders","dedup_key":"order-42","cancelled":false,"copies_cancelled":0,"copies_delivering":0}`, out)
	require.Contains(t, errOut, "nothing cancelled")

	// Two groups, one delivering its copy: the other's is cancelled, and
	// the command says the message is still delivered.
	for _, g := range []string{"mail", "sms"} {
		require.NoError(t, pgoutbox.Bind(context.Background(), env.Exec(), env.Tables, "two", g))
	}
	_, errOut, code = cliRun(t, env, "publish", "--topic", "two", "--payload", "x", "--delay", "1h", "--dedup-key", "order-43")
	require.Equal(t, 0, code, errOut)
	_, err := env.Pool.Exec(context.Background(), `UPDATE outbox SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 minute' WHERE consumer_group = 'mail'`)
	require.NoError(t, err)
	out, errOut, code = cliRun(t, env, "cancel", "--topic", "two", "--dedup-key", "order-43", "--json")
	require.Equal(t, exitError, code, errOut)
	require.JSONEq(t, `{"topic":"two","dedup_key":"order-43","cancelled":false,"copies_cancelled":1,"copies_delivering":1}`, out)
	require.Contains(t, errOut, "is being delivered in 1 consumer group(s)")
	_, _, code = cliRun(t, env, "cancel", "--topic", "reminders")
	require.Equal(t, exitUsage, code)
}

// debugVersion is the module version the test binary's build stamped
// into the CLI binary: both are built from the same tree with the same flags.
func debugVersion() string {
	out, err := exec.Command("go", "version", "-m", binary).Output()
	if err != nil {
		return "(devel)"
	}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == "mod" {
			return f[2]
		}
	}
	return "(devel)"
}

// Ctrl-C cancels the statement under way on the server, not only the
// process: a conversion whose index build waits for a transaction left
// open elsewhere stops building when interrupted (killing the process
// would leave the build running, waiting), says so, and runs again to the
// end afterwards.
func TestInterruptCancelsTheStatementOnTheServer(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "conv", "kept")
	ctx := context.Background()
	holder, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx) //nolint:errcheck // ends the snapshot
	_, err = holder.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	var n int
	// A snapshot, no lock on the outbox: the table change goes on, the
	// index build waits for it.
	require.NoError(t, holder.QueryRow(ctx, `SELECT count(*) FROM pg_catalog.pg_class`).Scan(&n))

	building := func() int {
		var b int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE query LIKE 'CREATE %INDEX CONCURRENTLY%' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()`, env.Schema).Scan(&b))
		return b
	}
	cmd := exec.Command(binary, "schema", "convert-to-rotating", "--yes", "--dsn", env.DSN, "--schema", env.Schema)
	cmd.Env = cliEnv()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	require.Eventually(t, func() bool { return building() == 1 }, 20*time.Second, 20*time.Millisecond, "the build waits for the open transaction")
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	err = cmd.Wait()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "an interrupted conversion fails")
	require.Contains(t, stderr.String(), "interrupted")
	require.Eventually(t, func() bool { return building() == 0 }, 10*time.Second, 20*time.Millisecond, "the build was cancelled on the server")

	require.NoError(t, holder.Rollback(ctx))
	out, errOut, code := cliRun(t, env, "schema", "convert-to-rotating", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "is a rotating outbox")
}
