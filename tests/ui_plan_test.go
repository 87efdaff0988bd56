package tests

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// TestUIStatementsUseIndexes pins that no statement a page of pgoutboxui
// runs reads the outbox sequentially: on 200,000 rows in 20 topics × 3
// groups, the group page's Stats, Peek and blocked-key lookup are range
// scans of the group's indexes, whatever the plan cache does. (The
// overview runs no statement of its own: it shows the sampler's latest
// Stats, one pass over the table per sample interval, documented in
// docs/ui.md. Dead-letter statements read the dead-letter table.)
func TestUIStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tbl := b.Schema + ".outbox"
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s (topic, consumer_group, uuid, payload, metadata, available_at, deliveries, lease_token, leased_until, ordering_key)
SELECT 'topic-' || (g %% 20), 'group-' || (g / 20 %% 3), g::text, '\x00', '{}',
       now() + CASE WHEN g %% 7 = 0 THEN interval '1 hour' ELSE -interval '1 minute' END,
       g %% 5,
       CASE WHEN g %% 11 = 0 THEN gen_random_uuid() END,
       CASE WHEN g %% 11 = 0 THEN now() + interval '1 minute' END,
       CASE WHEN g %% 3 = 0 THEN 'key-' || (g %% 1000) END
  FROM generate_series(1, 200000) g`, tbl))
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason, failed_at)
SELECT g, 'topic-' || (g %% 20), 'group-' || (g %% 3), g::text, '\x00', '{}', now(), 3, 'rejected', now() - g * interval '1 second'
  FROM generate_series(1, 20000) g`, b.Schema))
	require.NoError(t, err)
	for _, tb := range []string{tbl, b.Schema + ".outbox_dlq", b.Schema + ".outbox_bindings", b.Schema + ".outbox_paused"} {
		_, err = b.Pool.Exec(ctx, "ANALYZE "+tb)
		require.NoError(t, err)
	}
	n, err := query.NewNames(b.Schema, "outbox", "outbox_dlq")
	require.NoError(t, err)
	null := pgtype.Text{}
	noTime := pgtype.Timestamptz{}
	statements := []struct {
		name string
		sql  string
		args []any
	}{
		{"group stats", query.Stats(n, true, true), []any{"topic-3", "group-1"}},
		{"peek", query.Peek(n), []any{"topic-3", "group-1", 50, 65536}},
		{"blocked keys", query.UIBlockedKeys(n), []any{"topic-3", "group-1", 3, 20}},
		{"paused groups", query.PausedGroups(n, false), nil},
		{"bindings", query.UIBindings(n), nil},
		{"dead letters of a topic", query.DeadLetters(n, true), []any{pgtype.Text{String: "topic-3", Valid: true}, null, null, noTime, noTime, noTime, int64(0), int64(51), 1024}},
		{"dead letters", query.DeadLetters(n, false), []any{null, null, null, noTime, noTime, noTime, int64(0), int64(51), 1024}},
		{"dead letter by id", query.UIDeadLettersByID(n), []any{[]int64{42}, 1}},
		{"count dead letters", query.UICountDeadLetters(n, true), []any{pgtype.Text{String: "topic-3", Valid: true}, null, null, noTime, noTime, noTime, int64(0)}},
		{"table counters", query.UITableCounters, []any{n.QTable}},
	}
	seq := regexp.MustCompile(`Seq Scan on outbox( |$)`)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for _, st := range statements {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			_, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode)
			require.NoError(t, err)
			text := explain(t, conn, st.sql, st.args...)
			require.NotRegexp(t, seq, text, "%s (%s) must not scan the outbox:\n%s", st.name, mode, text)
			if strings.Contains(st.name, "dead letters of a topic") {
				require.Contains(t, text, n.DLQIdx, "%s (%s) reads the (topic, failed_at) index", st.name, mode)
			}
		}
	}
	_, err = conn.Exec(ctx, "RESET plan_cache_mode")
	require.NoError(t, err)
	// The check sees a pass over the table where there is one: the
	// sampler's Stats of every topic, which no page runs.
	var plan []string
	rows, err := conn.Query(ctx, "EXPLAIN "+query.Stats(n, false, false))
	require.NoError(t, err)
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	require.Regexp(t, seq, strings.Join(plan, "\n"))
}
