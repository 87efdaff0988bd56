package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// move into a group that is not bound warns in a whole sentence, with the
// command that binds it.
func TestMoveIntoAnUnboundGroupWarns(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", "old")
	require.Equal(t, 0, code, errOut)
	publish(t, env, "orders", "a")
	out, errOut, code := cliRun(t, env, "move", "--topic", "orders", "--from", "old", "--to", "new", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "moved 1 message(s)")
	require.Contains(t, out, `warning: group new is not bound to "orders": the moved messages wait for it, but it gets no copy of what is published until it is bound; `+
		`bind it (pgoutbox bind --topic orders --group new), or start its subscribers, whose Subscribe binds it`+"\n")

	_, errOut, code = cliRun(t, env, "bind", "--topic", "orders", "--group", "new")
	require.Equal(t, 0, code, errOut)
	out, errOut, code = cliRun(t, env, "move", "--topic", "orders", "--from", "old", "--to", "new", "--yes")
	require.Equal(t, 0, code, errOut)
	require.NotContains(t, out, "warning")
}

// An error that wraps another names pgoutbox once: schema migrate on a
// rotating outbox.
func TestMigrateErrorNamesPgoutboxOnce(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true})
	_, errOut, code := cliRun(t, env, "schema", "migrate", "down", "--yes")
	require.Equal(t, exitError, code, errOut)
	require.True(t, strings.HasPrefix(errOut, "pgoutbox: migrate: the versioned migrations describe a single-table outbox"), errOut)
	require.Equal(t, 1, strings.Count(errOut, "pgoutbox:"), errOut)
	_, dryErr, code := cliRun(t, env, "schema", "migrate", "down", "--dry-run")
	require.Equal(t, exitError, code, "a dry run refuses what the run would")
	require.Equal(t, errOut, dryErr)

	require.Equal(t, "migrate: the outbox: x", once("pgoutbox: migrate: pgoutbox: the outbox: x"))
	require.Equal(t, "a: b: c", once("a: pgoutbox: b: pgoutbox: c"))
}

// An outbox made without a dead-letter table: dlq list without --no-dlq
// says to pass it (schema apply would give the outbox one); with --no-dlq
// it names the commands that show and requeue parked rows.
func TestDLQWithoutADeadLetterTable(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{NoDeadLetterTable: true})
	_, errOut, code := cliRun(t, env, "dlq", "list")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, errOut, "has no dead-letter table")
	require.Contains(t, errOut, "pass --no-dlq")
	require.Contains(t, errOut, `to give it one, run "pgoutbox schema apply"`)
	require.NotContains(t, errOut, "to create the tables")
	require.Equal(t, 1, strings.Count(errOut, "pgoutbox:"), errOut)

	for _, sub := range [][]string{{"list"}, {"show", "1"}, {"delete", "--id", "1", "--yes"}, {"purge", "--older-than", "0", "--yes"}} {
		_, errOut, code = cliRun(t, env, append([]string{"--no-dlq", "dlq"}, sub...)...)
		require.Equal(t, exitError, code, "%v: %s", sub, errOut)
		require.Contains(t, errOut, `"pgoutbox peek --topic T [--group G]"`, "%v", sub)
		require.Contains(t, errOut, `"pgoutbox dlq requeue --no-dlq`, "%v", sub)
		require.NotContains(t, errOut, "RequeueParked", "%v", sub)
		require.NotContains(t, errOut, "Peek", "%v", sub)
	}

	// A dead-letter table that is missing with the outbox: the usual hint.
	_, errOut, code = cliRun(t, env, "dlq", "list", "--table", "missing_outbox")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, errOut, `run "pgoutbox schema apply" to create the tables`)
	require.NotContains(t, errOut, "--no-dlq")
}

// A subscriber still set to Rotating after schema convert-to-single logs
// what is true of a single table, not of partitions.
func TestRotationErrorAfterConvertToSingle(t *testing.T) {
	t.Parallel()
	logger := &errorLog{}
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true, Logger: logger,
		Subscriber: func(c *pgoutbox.SubscriberConfig) { c.RotationWindow = 100 * time.Millisecond }})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := env.Subscriber.Subscribe(ctx, "rot") // starts the rotator
	require.NoError(t, err)

	out, errOut, code := cliRun(t, env, "schema", "convert-to-single", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "Unset Rotating")
	rotationErrors := func() []string {
		var msgs []string
		for _, m := range logger.errors() {
			if strings.HasPrefix(m, "Rotating the outbox failed") {
				msgs = append(msgs, m)
			}
		}
		return msgs
	}
	require.Eventually(t, func() bool { return len(rotationErrors()) > 0 }, 10*time.Second, 20*time.Millisecond)
	msgs := rotationErrors()
	require.Contains(t, msgs[0], "it is a single table now")
	require.Contains(t, msgs[0], "unset Rotating")
	require.NotContains(t, msgs[0], "partition")
}

// dlq requeue --id and dlq delete --id of an id that is not a dead letter
// both exit 1 (nothing to act on), as documented.
func TestDLQUnknownIDExitsOne(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ids := deadLetters(t, env, "orders", 1)
	unknown := fmt.Sprint(ids[0] + 1000)
	for _, sub := range []string{"requeue", "delete"} {
		out, errOut, code := cliRun(t, env, "dlq", sub, "--id", unknown, "--yes")
		require.Equal(t, exitError, code, "%s: %s%s", sub, out, errOut)
		require.Contains(t, errOut, "1 of the ids were not dead letters", sub)
	}
	// One requeued, one not: the requeue happens, and the exit is 1.
	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--id", fmt.Sprint(ids[0]), "--id", unknown, "--yes")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, out, "requeued 1 dead letter(s)")
	require.Contains(t, errOut, "1 of the ids were not dead letters")

	// Without a dead-letter table the ids are parked rows.
	parked := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{NoDeadLetterTable: true})
	out, errOut, code = cliRun(t, parked, "dlq", "requeue", "--no-dlq", "--id", "4242", "--yes")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, out, "requeued 0 parked message(s)")
	require.Contains(t, errOut, "1 of the ids were not parked messages")
}

// A dead letter whose dedup key a message in the outbox holds stays: the
// requeue says so, and exits 1.
func TestDLQRequeueHeldDedupKey(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := env.Subscriber.Subscribe(ctx, "keyed")
	require.NoError(t, err)
	_, errOut, code := cliRun(t, env, "publish", "--topic", "keyed", "--payload", "first", "--dedup-key", "k1")
	require.Equal(t, 0, code, errOut)
	rejectNext(t, msgs)
	var id int64
	require.Eventually(t, func() bool {
		page, err := pgoutbox.DeadLetters(context.Background(), env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: "keyed"})
		if err != nil || len(page.Letters) != 1 {
			return false
		}
		id = page.Letters[0].ID
		return true
	}, 10*time.Second, 20*time.Millisecond)
	cancel()
	out, errOut, code := cliRun(t, env, "publish", "--topic", "keyed", "--payload", "second", "--dedup-key", "k1", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"skipped": false`)

	out, errOut, code = cliRun(t, env, "dlq", "requeue", "--id", fmt.Sprint(id), "--yes")
	require.Equal(t, exitError, code, out+errOut)
	require.Contains(t, out, "requeued 0 dead letter(s)")
	require.Contains(t, errOut, fmt.Sprintf("1 of the ids were not requeued: %d still dead letter(s), as a message in the outbox holds each one's dedup key", id))

	// By filter: the same reason, not a bare "requeued 0".
	out, errOut, code = cliRun(t, env, "dlq", "requeue", "--topic", "keyed", "--yes")
	require.Equal(t, 0, code, out+errOut)
	require.Contains(t, out, "requeued 0 dead letter(s)")
	require.Contains(t, out, fmt.Sprintf("1 matching dead letter(s) stayed (first id %d): a message in the outbox holds the dedup key", id))
}

// A requeued message that a running subscriber takes and fails again is a
// dead letter again, under its id, by the time the requeue looks: it was
// requeued, and is not reported as one that stayed.
func TestDLQRequeueOfAMessageThatFailsAgainIsNotSaidToStay(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := env.Subscriber.Subscribe(ctx, "again")
	require.NoError(t, err)
	_, errOut, code := cliRun(t, env, "publish", "--topic", "again", "--payload", "x")
	require.Equal(t, 0, code, errOut)
	rejectNext(t, msgs)
	dead := func() int {
		page, err := pgoutbox.DeadLetters(context.Background(), env.Exec(), env.Tables, pgoutbox.DeadLetterFilter{Topic: "again"})
		require.NoError(t, err)
		return len(page.Letters)
	}
	require.Eventually(t, func() bool { return dead() == 1 }, 10*time.Second, 20*time.Millisecond)
	go func() { // every delivery rejected, at once
		for m := range msgs {
			_ = pgoutbox.Reject(m, "test rejection")
			m.Nack()
		}
	}()
	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--topic", "again", "--yes")
	require.Equal(t, 0, code, out+errOut)
	require.Contains(t, out, "requeued 1 dead letter(s)")
	require.NotContains(t, out, "stayed")
	require.Eventually(t, func() bool { return dead() == 1 }, 10*time.Second, 20*time.Millisecond, "failed again")
}

// --rotating, --arrivals and --json, like the connection flags, work
// before the command.
func TestGlobalFlagsBeforeTheCommand(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "orders", "a")
	// The command parses --rotating: on a single table it contradicts the database.
	_, errOut, code := cliRun(t, nil, "--rotating", "--dsn", env.DSN, "--schema", env.Schema, "stats")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "is a single table, not a rotating outbox")
	require.NotContains(t, errOut, "unknown command")

	out, errOut, code := cliRun(t, nil, "--rotating=false", "--arrivals", "--json", "--dsn", env.DSN, "--schema", env.Schema, "stats")
	require.Equal(t, 0, code, errOut)
	var stats []statsJSON
	require.NoError(t, json.Unmarshal([]byte(out), &stats), out)
	require.Len(t, stats, 1)

	// A command without --json says so.
	_, errOut, code = cliRun(t, nil, "--json", "bind", "--topic", "orders")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "-json")
}

// pause and resume of a group not bound to the topic do it, and note on
// stderr that the group is not bound; a bound group gets no note.
func TestPauseResumeUnboundGroupNotes(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	for _, cmd := range []string{"pause", "resume"} {
		out, errOut, code := cliRun(t, env, cmd, "--topic", "orders", "--group", "bilING")
		require.Equal(t, 0, code, errOut)
		require.NotEmpty(t, out)
		require.Contains(t, errOut, `pgoutbox: note: group bilING is not bound to topic "orders" (mistyped?)`, cmd)
		require.Contains(t, errOut, `"pgoutbox stats --topic orders" lists the topic's groups`, cmd)
	}
	_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)
	for _, cmd := range []string{"pause", "resume"} {
		out, errOut, code := cliRun(t, env, cmd, "--topic", "orders", "--group", "billing")
		require.Equal(t, 0, code, errOut)
		require.Contains(t, out, "group billing of topic")
		require.Empty(t, errOut, cmd)
	}
}

// errorLog keeps the messages of the errors logged to it; unlike
// Watermill's CaptureLoggerAdapter (whose Captured returns the map it
// goes on writing), it may be read while the code under test logs.
type errorLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *errorLog) Error(msg string, _ error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msg)
}
func (l *errorLog) Info(string, watermill.LogFields)                 {}
func (l *errorLog) Debug(string, watermill.LogFields)                {}
func (l *errorLog) Trace(string, watermill.LogFields)                {}
func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errorLog) errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.msgs)
}

// --older-than with a day count past time.Duration's range wrapped around:
// 213504d became 25m26s and purged a dead letter that failed an hour ago.
func TestPurgeOlderThanPastADurationIsRefused(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", "x")
	_, err := env.Pool.Exec(context.Background(), `UPDATE "`+env.Schema+`"."`+env.Tables.DeadLetterTable+`" SET failed_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	out, errOut, code := cliRun(t, env, "dlq", "purge", "--older-than", "213504d", "--yes")
	require.NotContains(t, out, "purged 1", "a dead letter an hour old was purged by --older-than 213504d (%s)", errOut)
	require.Equal(t, exitUsage, code, "an age past what a duration holds is a usage error: %s%s", out, errOut)
}

// Dead letters requeued into a group no longer bound to their topic
// (renamed, unbound) wait where no subscriber claims them: requeue says
// so, as move and pause do.
func TestRequeueIntoAnUnboundGroupWarns(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", "x") // the default group's
	_, err := pgoutbox.Unbind(context.Background(), env.Exec(), env.Tables, "orders", "", false)
	require.NoError(t, err)
	_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, 0, code, errOut)

	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--all", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "requeued 1")
	require.Contains(t, out+errOut, "not bound", "the requeued letter waits in a group nobody consumes; say so")
}

// stats ends its warning about a stranded group with "or unbind --purge";
// that command deleted the rows and then exited 1 ("nothing to act on"),
// so a script took the purge for a failure.
func TestUnbindPurgeOfAStrandedGroupSucceeds(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", "old")
	require.Equal(t, 0, code, errOut)
	publish(t, env, "orders", "a")
	_, errOut, code = cliRun(t, env, "unbind", "--topic", "orders", "--group", "old")
	require.Equal(t, 0, code, errOut)
	out, _, _ := cliRun(t, env, "stats")
	require.Contains(t, out, "or unbind --purge", "the remedy stats gives")

	out, errOut, code = cliRun(t, env, "unbind", "--topic", "orders", "--group", "old", "--purge", "--yes")
	require.Contains(t, out, "deleted 1 pending message(s)")
	require.Equal(t, 0, code, "the stranded message was deleted, as asked: %s%s", out, errOut)
}

// A misspelt --reason matched nothing, and a requeue or purge reported 0
// with exit 0; a bare number for a duration said only "parse error".
func TestMistypedReasonAndDurationSayWhatToWrite(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", "x")
	for _, args := range [][]string{
		{"dlq", "requeue", "--reason", "rejcted", "--yes"},
		{"dlq", "purge", "--older-than", "0", "--reason", "rejcted", "--yes"},
		{"dlq", "list", "--reason", "rejcted"},
	} {
		_, errOut, code := cliRun(t, env, args...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		require.Contains(t, errOut, "use one of max_deliveries, retry_exhausted, rejected, poisoned", args)
	}
	out, errOut, code := cliRun(t, env, "dlq", "list", "--reason", "rejected", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"failure_reason": "rejected"`)

	_, errOut, code = cliRun(t, env, "publish", "--topic", "orders", "--payload", "x", "--delay", "5")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "give it with its unit, as 30s")
	_, errOut, code = cliRun(t, env, "publish", "--topic", "orders", "--payload", "x", "--delay", "3000000h")
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "longer than a duration can be")
}

// A payload over the limit told CLI users to raise MaxPayloadBytes, which
// the CLI had no way to; --max-payload-bytes is that way.
func TestPublishOverThePayloadLimitSaysTheFlag(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	big := filepath.Join(t.TempDir(), "big")
	require.NoError(t, os.WriteFile(big, []byte(strings.Repeat("a", pgoutbox.DefaultMaxPayloadBytes+1)), 0o600))
	_, errOut, code := cliRun(t, env, "publish", "--topic", "big", "--payload-file", big)
	require.Equal(t, exitUsage, code, errOut)
	require.Contains(t, errOut, "--max-payload-bytes")
	env.RequireNotPublished(t, env.Exec(), "big")
	_, errOut, code = cliRun(t, env, "publish", "--topic", "big", "--payload-file", big, "--max-payload-bytes", "-1")
	require.Equal(t, 0, code, errOut)
	env.RequirePublished(t, env.Exec(), "big", pgoutboxtest.Count(1))
}

// rename renames a group's binding and moves its waiting rows; renaming a
// group that is not bound is "nothing to act on" (exit 1), onto a bound
// one says what to do instead.
func TestRenameAGroup(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	for _, g := range []string{"billing", "shipping"} {
		_, errOut, code := cliRun(t, env, "bind", "--topic", "orders", "--group", g)
		require.Equal(t, 0, code, errOut)
	}
	publish(t, env, "orders", "a", "b")
	out, errOut, code := cliRun(t, env, "rename", "--topic", "orders", "--from", "billing", "--to", "invoicing", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "moved 2 waiting message(s)")
	out, _, _ = cliRun(t, env, "stats", "--topic", "orders", "--json")
	require.Contains(t, out, `"consumer_group": "invoicing"`)
	require.NotContains(t, out, `"consumer_group": "billing"`)

	_, errOut, code = cliRun(t, env, "rename", "--topic", "orders", "--from", "billing", "--to", "x", "--yes")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, errOut, "not bound")
	_, errOut, code = cliRun(t, env, "rename", "--topic", "orders", "--from", "invoicing", "--to", "shipping", "--yes")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, errOut, "bound to it already")
	_, errOut, code = cliRun(t, env, "rename", "--topic", "orders", "--from", "invoicing", "--to", "x")
	require.Equal(t, exitRefused, code, "asks, and refuses without a terminal: %s", errOut)

	// A row the old name's running subscriber holds stays with it: said.
	_, err := env.Pool.Exec(context.Background(), `UPDATE "`+env.Schema+`".outbox SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 hour'
		WHERE id = (SELECT min(id) FROM "`+env.Schema+`".outbox WHERE consumer_group = 'invoicing')`)
	require.NoError(t, err)
	out, errOut, code = cliRun(t, env, "rename", "--topic", "orders", "--from", "invoicing", "--to", "billing", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "moved 1 waiting message(s)")
	require.Contains(t, errOut, "1 message(s) of group invoicing are being delivered")
	require.Contains(t, errOut, "pgoutbox move --topic orders --from invoicing --to billing")
}

// After a requeue by id, the warnings about messages nobody consumes are
// those of the topics requeued: a requeue of one dead letter listed every
// topic of the outbox with messages published before a binding (51 of
// them on an operator's outbox), and nothing about its own.
func TestRequeueByIDWarnsAboutItsOwnTopicsOnly(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	publish(t, env, "other", "x") // nothing bound: a warning of its own in stats
	ctx := context.Background()
	var id int64
	require.NoError(t, env.Pool.QueryRow(ctx, fmt.Sprintf(`
INSERT INTO %s.%s (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason, failed_at)
VALUES (424242, 'orders', 'billing', 'u-1', '\x00', '{}', now(), 3, 'rejected', now()) RETURNING id`, env.Schema, env.Tables.DeadLetterTable)).Scan(&id))

	out, errOut, code := cliRun(t, env, "dlq", "requeue", "--id", fmt.Sprint(id), "--yes")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `warning: group billing is not bound to topic "orders" and holds 1 message(s)`)
	require.NotContains(t, out, `"other"`, "a topic it did not requeue")
	out, _, _ = cliRun(t, env, "stats")
	require.Contains(t, out, `topic "other" were published while nothing was bound`, "stats still says it")
}
