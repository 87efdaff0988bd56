package tests

import (
	"context"
	"fmt"
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
	require.Equal(t, pgoutbox.QueueStats{Topic: "b", ConsumerGroup: "idle"}, all[3], "a bound group without rows reports zeros")

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

	// Without a dead-letter table (configured, or configured and missing).
	noDLQ := schema.Config{Schema: b.Schema, Table: "outbox", NoDeadLetterTable: true}
	s, err := pgoutbox.Stats(ctx, exec, noDLQ, pgoutbox.StatsForGroup("a", ""))
	require.NoError(t, err)
	require.Nil(t, s[0].DeadLetters)
	missing := schema.Config{Schema: b.Schema, Table: "outbox", DeadLetterTable: "not_there"}
	_, err = pgoutbox.Stats(ctx, exec, missing)
	require.NoError(t, err)

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
	b.addDeadLetters(t, 1_000_000, 20000, "topic-1", "g1", "rejected", time.Hour)
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

func explain(t *testing.T, conn *pgxpool.Conn, stmt string, args ...any) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), "EXPLAIN "+stmt, args...)
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
