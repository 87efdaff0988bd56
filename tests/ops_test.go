package tests

import (
	"context"
	"fmt"
	"github.com/jackc/pgx/v5"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// exec runs SQL against the test schema ("%s" is the schema name).
func (b *bundle) exec(t testing.TB, q string, args ...any) {
	t.Helper()
	_, err := b.Pool.Exec(context.Background(), strings.ReplaceAll(q, "%s", b.Schema), args...)
	require.NoError(t, err)
}

// addDeadLetters inserts n dead letters of topic/group/reason, failed
// age ago, with ids from firstID.
func (b *bundle) addDeadLetters(t testing.TB, firstID, n int, topic, group, reason string, age time.Duration) {
	t.Helper()
	_, err := b.Pool.Exec(context.Background(), fmt.Sprintf(`
INSERT INTO %s.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, last_error, failure_reason, failed_by, failed_at)
SELECT g, $1, $2, 'u-' || g, convert_to('p-' || g, 'UTF8'), jsonb_build_object('k', 'v' || g), now() - interval '1 day', 3,
       'boom', $3, 'host:1:abc', now() - $4::bigint * interval '1 microsecond' + g * interval '1 microsecond'
  FROM generate_series($5::int, $5::int + $6::int - 1) g`, b.Schema), topic, group, reason, age.Microseconds(), firstID, n)
	require.NoError(t, err)
}

func TestStatsCounts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	// Topic a, default group: 3 ready (oldest due 1 minute ago), 2
	// scheduled, 1 parked, 2 leased, 1 expired lease. Topic a, group g:
	// 1 ready. Topic b: group "idle" bound, no rows; dead letters only in
	// group "dlq-only".
	b.exec(t, `
INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, available_at) VALUES
 ('a', '', 'r1', '', now() - interval '1 minute'), ('a', '', 'r2', '', now()), ('a', '', 'r3', '', now()),
 ('a', '', 's1', '', now() + interval '1 hour'), ('a', '', 's2', '', now() + interval '1 day'),
 ('a', '', 'p1', '', 'infinity'),
 ('a', 'g', 'g1', '', now())`)
	b.exec(t, `
INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, lease_token, leased_until) VALUES
 ('a', '', 'l1', '', gen_random_uuid(), now() + interval '1 minute'),
 ('a', '', 'l2', '', gen_random_uuid(), now() + interval '1 minute'),
 ('a', '', 'e1', '', gen_random_uuid(), now() - interval '1 second')`)
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "b", "idle"))
	b.addDeadLetters(t, 1000, 2, "a", "", "rejected", time.Hour)
	b.addDeadLetters(t, 2000, 1, "a", "", "poisoned", time.Hour)
	b.addDeadLetters(t, 3000, 4, "b", "dlq-only", "max_deliveries", time.Hour)

	all, err := pgoutbox.Stats(ctx, exec, b.tables)
	require.NoError(t, err)
	require.Len(t, all, 4, "%+v", all)
	a := all[0]
	require.Equal(t, "a", a.Topic)
	require.Equal(t, "", a.ConsumerGroup)
	require.EqualValues(t, 3, a.Ready)
	require.EqualValues(t, 2, a.Scheduled)
	require.EqualValues(t, 1, a.Parked)
	require.EqualValues(t, 2, a.Leased)
	require.EqualValues(t, 1, a.ExpiredLeases)
	require.GreaterOrEqual(t, a.OldestReadyAge, time.Minute)
	require.Less(t, a.OldestReadyAge, time.Hour)
	require.Equal(t, map[string]int64{"rejected": 2, "poisoned": 1}, a.DeadLetters)
	require.Equal(t, pgoutbox.QueueStats{Topic: "a", ConsumerGroup: "g", Ready: 1, OldestReadyAge: all[1].OldestReadyAge}, all[1])
	require.Equal(t, pgoutbox.QueueStats{Topic: "b", ConsumerGroup: "dlq-only", DeadLetters: map[string]int64{"max_deliveries": 4}}, all[2])
	require.Equal(t, pgoutbox.QueueStats{Topic: "b", ConsumerGroup: "idle", Bound: true}, all[3], "a bound group without rows reports zeros")
	require.False(t, a.Bound, "nothing bound topic a: its rows are unbound")
	require.EqualValues(t, 3+2+1+2+1, a.Unbound())
	require.Zero(t, all[3].Unbound())

	// The lag grows between calls: compare the rest.
	noLag := func(s []pgoutbox.QueueStats) []pgoutbox.QueueStats {
		out := append([]pgoutbox.QueueStats(nil), s...)
		for i := range out {
			out[i].OldestReadyAge = 0
		}
		return out
	}
	topicA, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic("a"))
	require.NoError(t, err)
	require.Equal(t, noLag(all[:2]), noLag(topicA))

	one, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForGroup("a", ""))
	require.NoError(t, err)
	require.Equal(t, noLag(all[:1]), noLag(one))
	none, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForGroup("nobody", "x"))
	require.NoError(t, err)
	require.Equal(t, []pgoutbox.QueueStats{{Topic: "nobody", ConsumerGroup: "x"}}, none)

	// Without a dead-letter table. One named but missing is a
	// configuration that does not match the outbox: counting no dead
	// letters would silence the alerts on them.
	noDLQ := schema.Config{Schema: b.Schema, Table: "outbox", NoDeadLetterTable: true}
	s, err := pgoutbox.Stats(ctx, exec, noDLQ, pgoutbox.StatsForGroup("a", ""))
	require.NoError(t, err)
	require.Nil(t, s[0].DeadLetters)
	missing := schema.Config{Schema: b.Schema, Table: "outbox", DeadLetterTable: "not_there"}
	_, err = pgoutbox.Stats(ctx, exec, missing)
	require.ErrorContains(t, err, `"not_there" does not exist`)
	require.ErrorContains(t, err, "NoDeadLetterTable")

	// Through database/sql, in a transaction.
	sqlTx, err := b.sqlDB(t).BeginTx(ctx, nil)
	require.NoError(t, err)
	defer sqlTx.Rollback()
	viaSQL, err := pgoutbox.Stats(ctx, tx.FromSQLTx(sqlTx), b.tables)
	require.NoError(t, err)
	require.Len(t, viaSQL, 4)
	require.Equal(t, all[0].Ready, viaSQL[0].Ready)

	// Bad input.
	_, err = pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic(""))
	require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
	_, err = pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForGroup("a", "bad\x00"))
	require.ErrorIs(t, err, pgoutbox.ErrInvalidGroup)
	_, err = pgoutbox.Stats(ctx, nil, b.tables)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.Stats(ctx, exec, schema.Config{Table: "no-pe"})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

// A message due at once counts as ready, however the publish's
// transaction and the statement's overlap: published by a transaction
// that began after the one Stats runs in and committed before Stats read,
// its available_at (its own transaction's now()) is later than the Stats
// transaction's now(), and it counted as scheduled (a few on every busy
// topic: the scheduled gauge showed messages nobody delayed).
func TestStatsCountsAMessagePublishedAfterItsTransactionBeganAsReady(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	statsTx, err := b.Pool.Begin(ctx) // READ COMMITTED: each statement sees what committed before it
	require.NoError(t, err)
	defer func() { _ = statsTx.Rollback(ctx) }()
	var began time.Time
	require.NoError(t, statsTx.QueryRow(ctx, "SELECT now()").Scan(&began))
	pollUntil(t, "the clock passes the transaction's start", 5*time.Second, nil, func() bool {
		var later bool
		require.NoError(t, b.Pool.QueryRow(ctx, "SELECT now() > $1", began).Scan(&later))
		return later
	})
	b.publishInTx(t, "a", true, newMsg("due now"))

	for _, opts := range [][]pgoutbox.StatsOption{nil, {pgoutbox.StatsForTopic("a")}, {pgoutbox.StatsForGroup("a", "")}} {
		st, err := pgoutbox.Stats(ctx, tx.FromPgxTx(statsTx), b.tables, opts...)
		require.NoError(t, err)
		require.Len(t, st, 1, "%+v", st)
		require.EqualValues(t, 1, st[0].Ready, "%d options: %+v", len(opts), st[0])
		require.EqualValues(t, 0, st[0].Scheduled, "%d options: %+v", len(opts), st[0])
	}
}

// TestStatsUsesIndexes pins the plans of the Stats statements for one
// topic and for one group: on a table large enough for the planner to
// care, each lease state is a range scan of its partial index and nothing
// reads the outbox or the dead-letter table sequentially. (The all-topics
// form counts every row and reads the table once: see query.Stats.)
func TestStatsUsesIndexes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.exec(t, `
INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, metadata, available_at, lease_token, leased_until)
SELECT 'topic-' || (g % 20), 'g' || (g % 3), g::text, '\x00', '{}',
       CASE WHEN g % 7 = 0 THEN now() + interval '1 hour' WHEN g % 11 = 0 THEN 'infinity' ELSE now() - interval '1 minute' END,
       CASE WHEN g % 5 = 0 THEN gen_random_uuid() END,
       CASE WHEN g % 5 = 0 THEN now() + CASE WHEN g % 10 = 0 THEN interval '1 minute' ELSE -interval '1 minute' END END
  FROM generate_series(1, 100000) g`)
	// Dead letters of many topics: a generic plan assumes a topic's share
	// of the table from their number (with one topic, every row).
	for i := range 20 {
		b.addDeadLetters(t, 1_000_000+i*1000, 1000, fmt.Sprintf("topic-%d", i), "g1", "rejected", time.Hour)
	}
	b.exec(t, `ANALYZE %s.outbox`)
	b.exec(t, `ANALYZE %s.outbox_dlq`)
	n := b.names(t)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for _, c := range []struct {
		name         string
		topic, group bool
		args         []any
	}{
		{"all", false, false, nil},
		{"topic", true, false, []any{"topic-3"}},
		{"group", true, true, []any{"topic-3", "g1"}},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			_, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode)
			require.NoError(t, err)
			text := explain(t, conn, query.Stats(n, c.topic, c.group), c.args...)
			t.Logf("%s %s:\n%s", c.name, mode, text)
			if c.topic {
				require.NotContains(t, text, "Seq Scan on outbox ", "%s %s", c.name, mode)
				require.Contains(t, text, n.ReadyIdx, "%s %s", c.name, mode)
				require.Contains(t, text, n.LeaseIdx, "%s %s", c.name, mode)
				dlq := explain(t, conn, query.DLQStats(n, c.topic, c.group), c.args...)
				require.NotContains(t, dlq, "Seq Scan", "%s %s:\n%s", c.name, mode, dlq)
			}
		}
	}
	_, err = conn.Exec(ctx, "RESET plan_cache_mode")
	require.NoError(t, err)
}

// explainAnalyze runs EXPLAIN (options) of stmt on q (a pool, connection
// or transaction: the statement runs) and returns the plan's text.
func explainAnalyze(t *testing.T, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, options, stmt string, args ...any) string {
	t.Helper()
	rows, err := q.Query(context.Background(), "EXPLAIN ("+options+") "+stmt, args...)
	require.NoError(t, err)
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	return strings.Join(plan, "\n")
}

// Under plan_cache_mode = force_generic_plan it explains the generic plan,
// the one a prepared statement runs with: EXPLAIN with parameters plans
// with their values, so stmt is prepared and EXPLAIN EXECUTE'd instead,
// with NULLs (a generic plan does not depend on the values; args only
// count the parameters).
func explain(t *testing.T, conn *pgxpool.Conn, stmt string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	var mode string
	require.NoError(t, conn.QueryRow(ctx, "SHOW plan_cache_mode").Scan(&mode))
	sql := "EXPLAIN " + stmt
	if mode == "force_generic_plan" && len(args) > 0 {
		_, err := conn.Exec(ctx, "PREPARE explained AS "+stmt)
		require.NoError(t, err)
		defer func() {
			_, err := conn.Exec(ctx, "DEALLOCATE explained")
			require.NoError(t, err)
		}()
		sql = "EXPLAIN EXECUTE explained(" + strings.Repeat("NULL, ", len(args)-1) + "NULL)"
		args = nil
	}
	rows, err := conn.Query(ctx, sql, args...)
	require.NoError(t, err)
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var l string
		require.NoError(t, rows.Scan(&l))
		lines = append(lines, l)
	}
	require.NoError(t, rows.Err())
	return strings.Join(lines, "\n")
}

func TestDeadLettersPagesAndFilters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 25, "a", "", "rejected", 2*time.Hour)
	b.addDeadLetters(t, 100, 5, "a", "billing", "max_deliveries", time.Hour)
	b.addDeadLetters(t, 200, 3, "b", "", "rejected", time.Minute)

	// Every dead letter, 10 per page, in (failed_at, id) order.
	var ids []int64
	f := pgoutbox.DeadLetterFilter{Limit: 10}
	for pages := 0; ; pages++ {
		require.Less(t, pages, 10)
		page, err := pgoutbox.DeadLetters(ctx, exec, b.tables, f)
		require.NoError(t, err)
		for _, d := range page.Letters {
			ids = append(ids, d.ID)
		}
		if page.Next.IsZero() {
			break
		}
		f.After = page.Next
	}
	require.Len(t, ids, 33)
	require.Equal(t, []int64{1, 2, 3}, ids[:3])
	require.Equal(t, []int64{200, 201, 202}, ids[30:])

	page, err := pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: "a", ConsumerGroup: new("billing")})
	require.NoError(t, err)
	require.Len(t, page.Letters, 5)
	require.True(t, page.Next.IsZero())
	d := page.Letters[0]
	require.Equal(t, int64(100), d.ID)
	require.Equal(t, "a", d.Topic)
	require.Equal(t, "billing", d.ConsumerGroup)
	require.Equal(t, "u-100", d.UUID)
	require.Equal(t, []byte("p-100"), d.Payload)
	require.Equal(t, "v100", d.Metadata.Get("k"))
	require.Equal(t, 3, d.Deliveries)
	require.Equal(t, "boom", d.LastError)
	require.Equal(t, "max_deliveries", d.FailureReason)
	require.Equal(t, "host:1:abc", d.FailedBy)
	require.False(t, d.FailedAt.IsZero())
	require.False(t, d.CreatedAt.IsZero())

	page, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{ConsumerGroup: new(""), Reason: "rejected", FailedAfter: time.Now().Add(-90 * time.Minute)})
	require.NoError(t, err)
	require.Len(t, page.Letters, 3, "only topic b's rows failed in the last 90 minutes")
	page, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{FailedBefore: time.Now().Add(-90 * time.Minute)})
	require.NoError(t, err)
	require.Len(t, page.Letters, 25)

	// Bad input says what to do.
	for _, bad := range []pgoutbox.DeadLetterFilter{
		{Limit: -1}, {Limit: pgoutbox.MaxDeadLetterLimit + 1}, {Topic: "x\x01"}, {ConsumerGroup: new("\x00")},
		{FailedAfter: time.Now(), FailedBefore: time.Now().Add(-time.Hour)}, {After: pgoutbox.DeadLetterCursor{ID: 3}},
	} {
		_, err := pgoutbox.DeadLetters(ctx, exec, b.tables, bad)
		require.Error(t, err, "%+v", bad)
	}
	_, err = pgoutbox.DeadLetters(ctx, exec, schema.Config{Schema: b.Schema, Table: "outbox", NoDeadLetterTable: true}, pgoutbox.DeadLetterFilter{})
	require.ErrorIs(t, err, pgoutbox.ErrNoDeadLetterTable)
	require.ErrorContains(t, err, "RequeueParked")
}

func TestRequeueDeadLetters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 3, "a", "billing", "rejected", time.Hour)
	b.addDeadLetters(t, 10, 3, "a", "", "retry_exhausted", time.Hour)
	// Row 3 has a dedup key that a live row holds: it must stay.
	b.exec(t, `UPDATE %s.outbox_dlq SET dedup_key = 'k' WHERE id IN (2, 3)`)
	b.exec(t, `INSERT INTO %s.outbox (id, topic, consumer_group, uuid, payload, dedup_key) OVERRIDING SYSTEM VALUE VALUES (5000, 'a', 'billing', 'live', '', 'k')`)

	moved, err := pgoutbox.RequeueDeadLetters(ctx, exec, b.tables, []int64{1, 3, 999})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "row 3's key is taken; 999 is no dead letter")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE id = 3`))
	var uuid, group, md string
	var deliveries int
	var lastErr, reason *string
	var due bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT uuid, consumer_group, metadata->>'k', deliveries, last_error, failure_reason, available_at <= now()
  FROM `+b.Schema+`.outbox WHERE id = 1`).Scan(&uuid, &group, &md, &deliveries, &lastErr, &reason, &due))
	require.Equal(t, "u-1", uuid)
	require.Equal(t, "billing", group)
	require.Equal(t, "v1", md)
	require.Zero(t, deliveries)
	require.Nil(t, lastErr)
	require.Nil(t, reason)
	require.True(t, due)

	// By filter: group billing's rest (row 2 takes key k? no: the live row
	// holds it, so row 2 stays too), then the default group's rows.
	moved, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: "a", ConsumerGroup: new("billing")})
	require.NoError(t, err)
	require.Zero(t, moved)
	moved, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Reason: "retry_exhausted", Limit: 2})
	require.NoError(t, err)
	require.EqualValues(t, 2, moved)
	moved, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Reason: "retry_exhausted"})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved)

	// A requeued message is delivered again to its group.
	sub := b.groupSubscriber(t, "", nil)
	ch, err := sub.Subscribe(ctx, "a")
	require.NoError(t, err)
	got := map[string]bool{}
	for range 3 {
		m := receive(t, ch, 10*time.Second)
		got[m.UUID] = true
		m.Ack()
	}
	require.Equal(t, map[string]bool{"u-10": true, "u-11": true, "u-12": true}, got)

	// With the key free again, row 2 (then 3 clashes with it) moves.
	b.exec(t, `DELETE FROM %s.outbox WHERE uuid = 'live'`)
	moved, err = pgoutbox.RequeueDeadLetters(ctx, exec, b.tables, []int64{2, 3})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "two dead letters with one key: one moves, the other stays")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))

	// Requeued in batches until a call moves nothing, the letters whose
	// keys are taken do not fill the batches and end it early.
	b.addDeadLetters(t, 20, 3, "c", "", "rejected", 2*time.Hour)
	b.addDeadLetters(t, 23, 3, "c", "", "rejected", time.Hour)
	b.exec(t, `UPDATE %s.outbox_dlq SET dedup_key = 'c' || id WHERE id BETWEEN 20 AND 22`)
	b.exec(t, `INSERT INTO %s.outbox (id, topic, consumer_group, uuid, payload, dedup_key) OVERRIDING SYSTEM VALUE
		SELECT 6000 + g, 'c', '', 'live-c' || g, '', 'c' || g FROM generate_series(20, 22) g`)
	var batches []int64
	for {
		moved, err := pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: "c", Limit: 2})
		require.NoError(t, err)
		if moved == 0 {
			break
		}
		batches = append(batches, moved)
	}
	require.Equal(t, []int64{2, 1}, batches, "the three free letters, past the three whose keys are taken")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE topic = 'c'`))

	_, err = pgoutbox.RequeueDeadLetters(ctx, exec, b.tables, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Limit: -5})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

func TestPurgeDeadLettersInBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 250, "a", "", "rejected", 48*time.Hour)
	b.addDeadLetters(t, 1000, 120, "b", "g", "rejected", 36*time.Hour)
	b.addDeadLetters(t, 2000, 7, "a", "", "rejected", time.Hour)

	n, err := pgoutbox.PurgeDeadLetters(ctx, exec, b.tables, 24*time.Hour, 50)
	require.NoError(t, err)
	require.EqualValues(t, 370, n)
	require.Equal(t, 7, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
	n, err = pgoutbox.PurgeDeadLetters(ctx, exec, b.tables, 0, 0)
	require.NoError(t, err)
	require.EqualValues(t, 7, n)

	_, err = pgoutbox.PurgeDeadLetters(ctx, exec, b.tables, -time.Hour, 10)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.PurgeDeadLetters(ctx, exec, b.tables, time.Hour, -1)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

// PurgeDeadLettersMatching deletes one topic's, group's or reason's old
// dead letters only, in batches.
func TestPurgeDeadLettersMatching(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 120, "a", "", "rejected", 48*time.Hour)
	b.addDeadLetters(t, 1000, 30, "a", "billing", "rejected", 48*time.Hour)
	b.addDeadLetters(t, 2000, 20, "b", "", "poisoned", 48*time.Hour)
	b.addDeadLetters(t, 3000, 5, "a", "", "rejected", time.Hour)

	n, err := pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 24*time.Hour,
		pgoutbox.DeadLetterFilter{Topic: "a", ConsumerGroup: new("")}, 50)
	require.NoError(t, err)
	require.EqualValues(t, 120, n, "topic a, default group, older than a day")
	require.Equal(t, 55, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))

	n, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{ConsumerGroup: new("billing")}, 0)
	require.NoError(t, err)
	require.EqualValues(t, 30, n)
	n, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{Reason: "poisoned"}, 0)
	require.NoError(t, err)
	require.EqualValues(t, 20, n)
	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`), "the recent ones stay")
	// FailedBefore bounds the time too, the earlier bound wins: a
	// confirmation's time, with letters failing after it.
	b.addDeadLetters(t, 4000, 2, "a", "", "rejected", 0)
	n, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{FailedBefore: time.Now().Add(-30 * time.Minute)}, 0)
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "those of an hour ago; not those of now")
	n, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 24*time.Hour, pgoutbox.DeadLetterFilter{FailedBefore: time.Now().Add(time.Hour)}, 0)
	require.NoError(t, err)
	require.Zero(t, n, "olderThan is the earlier bound here")
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))

	_, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{Limit: 3}, 0)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{Topic: "bad\x00topic"}, 0)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
}

// DeadLetterByID reads one dead letter; DeleteDeadLetters deletes some.
func TestDeadLetterByIDAndDelete(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 3, "a", "g", "rejected", time.Hour)

	d, ok, err := pgoutbox.DeadLetterByID(ctx, exec, b.tables, 2)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "a", d.Topic)
	require.Equal(t, "g", d.ConsumerGroup)
	require.Equal(t, "u-2", d.UUID)
	require.Equal(t, "p-2", string(d.Payload))
	require.Equal(t, "v2", d.Metadata.Get("k"))

	n, err := pgoutbox.DeleteDeadLetters(ctx, exec, b.tables, []int64{2, 3, 99})
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "99 is no dead letter")
	_, ok, err = pgoutbox.DeadLetterByID(ctx, exec, b.tables, 2)
	require.NoError(t, err)
	require.False(t, ok)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
	_, err = pgoutbox.DeleteDeadLetters(ctx, exec, b.tables, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

func TestRequeueParkedAndPeek(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	parked := schema.Config{Schema: b.Schema, Table: "parked", NoDeadLetterTable: true}
	require.NoError(t, schema.Create(ctx, exec, parked))
	_, err := b.Pool.Exec(ctx, `
INSERT INTO `+b.Schema+`.parked (topic, consumer_group, uuid, payload, metadata, available_at, deliveries, last_error, failure_reason) VALUES
 ('a', '', 'p1', 'x', '{"h":"1"}', 'infinity', 10, 'boom', 'retry_exhausted'),
 ('a', '', 'p2', 'x', '{}', 'infinity', 1, 'bad', 'rejected'),
 ('a', 'g', 'p3', 'x', '{}', 'infinity', 1, 'bad', 'rejected'),
 ('a', '', 'later', 'x', '{}', now() + interval '1 hour', 0, NULL, NULL),
 ('a', '', 'now', 'x', '{}', now() - interval '1 second', 0, NULL, NULL)`)
	require.NoError(t, err)

	pending, err := pgoutbox.Peek(ctx, exec, parked, "a", "", 0)
	require.NoError(t, err)
	require.Len(t, pending, 4)
	require.Equal(t, []string{"now", "later", "p1", "p2"}, []string{pending[0].UUID, pending[1].UUID, pending[2].UUID, pending[3].UUID})
	require.True(t, pending[2].Parked)
	require.Equal(t, "retry_exhausted", pending[2].FailureReason)
	require.Equal(t, "boom", pending[2].LastError)
	require.Equal(t, "1", pending[2].Metadata.Get("h"))
	require.False(t, pending[0].Parked)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.parked WHERE topic = 'a' AND consumer_group = '' AND lease_token IS NULL AND available_at <= now() OR uuid = 'later'`), "peek leases nothing")

	n, err := pgoutbox.RequeueParked(ctx, exec, parked, pgoutbox.ParkedFilter{Topic: "a", ConsumerGroup: new(""), Reason: "retry_exhausted"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	var deliveries int
	var lastErr, reason *string
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT deliveries, last_error, failure_reason FROM `+b.Schema+`.parked WHERE uuid = 'p1' AND available_at <= now()`).Scan(&deliveries, &lastErr, &reason))
	require.Zero(t, deliveries)
	require.Nil(t, lastErr)
	require.Nil(t, reason)
	n, err = pgoutbox.RequeueParked(ctx, exec, parked, pgoutbox.ParkedFilter{})
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "every group")
	s, err := pgoutbox.Stats(ctx, exec, parked, pgoutbox.StatsForTopic("a"))
	require.NoError(t, err)
	require.Zero(t, s[0].Parked+s[1].Parked)

	_, err = pgoutbox.RequeueParked(ctx, exec, parked, pgoutbox.ParkedFilter{IDs: []int64{}})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.RequeueParked(ctx, exec, parked, pgoutbox.ParkedFilter{Limit: -1})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.Peek(ctx, exec, parked, "a", "", -1)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.Peek(ctx, exec, parked, "", "", 1)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
}
