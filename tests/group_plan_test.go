package tests

import (
	"context"
	"os"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// TestBindStatementsUseIndexes pins the plans of the binding statements on
// a table large enough for the planner to care: topic and consumer group
// are correlated, and the plans that looked fine on a small table read the
// whole outbox per Bind (an unbound-row probe planned as a sequential scan)
// or per backlog batch (the cursor as a filter instead of an index bound).
// Neither plan may scan the outbox sequentially, custom or generic.
func TestBindStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload)
		SELECT CASE WHEN g % 2 = 0 THEN 'big' ELSE 'fresh' END, CASE WHEN g % 2 = 0 THEN 'a' ELSE '' END, g::text, '\x00'
		  FROM generate_series(1, 100000) g`)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('big', 'a'), ('fresh', 'r')`)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group, backlog_next, backlog_bound, backlog_end)
		SELECT 'big', 'c', 50000, max(id), max(id) FROM %s.outbox`)
	b.exec(t, `ANALYZE %s.outbox`)
	names, err := query.NewNames(b.Schema, "outbox", "")
	require.NoError(t, err)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	seq := regexp.MustCompile(`Seq Scan on outbox( |$)`)
	for _, st := range []struct {
		name, sql string
		args      []any
		want      []string
	}{
		{"bind state", query.BindState(names), []any{"big", []string{"a"}}, []string{names.ReadyIdx, names.LeaseIdx}},
		{"backlog copy", query.CopyBacklog(names), []any{"big", "c", 5000, "[]", "ch"}, []string{"Index Cond: ((id > "}},
		{"adopt", query.AdoptUnbound(names, false), []any{"fresh", 5000, "ch"}, []string{names.ReadyIdx, names.LeaseIdx}},
		{"adopt with copies", query.AdoptUnbound(names, true), []any{"fresh", 5000, "ch"}, []string{names.ReadyIdx, names.LeaseIdx}},
		{"move", query.MoveGroup(names), []any{"fresh", "", "x", 5000, "ch"}, []string{names.ReadyIdx, names.LeaseIdx}},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			_, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode)
			require.NoError(t, err)
			text := explain(t, conn, st.sql, st.args...)
			require.NotRegexp(t, seq, text, "%s (%s) must not scan the outbox sequentially:\n%s", st.name, mode, text)
			for _, w := range st.want {
				require.Contains(t, text, w, "%s (%s):\n%s", st.name, mode, text)
			}
		}
	}
}

// TestBacklogCopyWithTheStatisticsOfAnEmptyQueue runs a backlog copy's
// batch on an outbox whose statistics say it is (nearly) empty, the usual
// state of a queue that autovacuum analyzed while it was drained: the
// planner then takes every step of the statement for a row or two, and a
// join of two of them was a nested loop comparing 5,000 rows with 5,000
// (1.4 to 7 s a batch where 58 ms are usual). No step may compare a
// batch's rows with each other.
func TestBacklogCopyWithTheStatisticsOfAnEmptyQueue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload) VALUES ('big', 'a', 'x', '\x00')`)
	b.exec(t, `ANALYZE %s.outbox`)
	b.exec(t, `DELETE FROM %s.outbox`)
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload)
		SELECT 'big', 'a', g::text, '\x00' FROM generate_series(1, 5000) g`)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('big', 'a')`)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group, backlog_next, backlog_bound, backlog_end)
		SELECT 'big', 'c', 0, max(id), max(id) FROM %s.outbox`)
	names, err := query.NewNames(b.Schema, "outbox", "")
	require.NoError(t, err)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "BEGIN")
	require.NoError(t, err)
	defer conn.Exec(ctx, "ROLLBACK") //nolint:errcheck
	text := explainAnalyze(t, conn, "ANALYZE", query.CopyBacklog(names), "big", "c", 5000, "[]", "ch")
	require.Contains(t, text, "rows=5000", "the batch copied the 5,000 rows:\n%s", text)
	for _, m := range regexp.MustCompile(`Rows Removed by Join Filter: (\d+)`).FindAllStringSubmatch(text, -1) {
		n, err := strconv.Atoi(m[1])
		require.NoError(t, err)
		require.Less(t, n, 50000, "a step compared the batch's rows with each other:\n%s", text)
	}
}

// TestMeasureBindOnAMillionRows measures, by hand, a backlog copy and an
// adoption of 1,000,000 rows each, and a re-bind (what every Subscribe of
// a bound group does) on the 3,000,000-row table they leave:
//
//	PGOUTBOX_MEASURE_BIND=1 go test -run TestMeasureBindOnAMillionRows -v ./tests/
//
// Skipped otherwise (a minute or two of a shared machine).
func TestMeasureBindOnAMillionRows(t *testing.T) {
	if os.Getenv("PGOUTBOX_MEASURE_BIND") == "" {
		t.Skip("set PGOUTBOX_MEASURE_BIND=1 to measure")
	}
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "big", "a"))
	for _, row := range []string{`'big', 'a'`, `'fresh', ''`} {
		b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, metadata)
			SELECT `+row+`, gen_random_uuid()::text, convert_to(repeat('x', 100), 'UTF8'), '{"k":"v"}'
			  FROM generate_series(1, 1000000)`)
	}
	b.exec(t, `VACUUM ANALYZE %s.outbox`)

	start := time.Now()
	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "big", []string{"b"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.NoError(t, err)
	require.EqualValues(t, 1000000, res.Copied)
	t.Logf("backlog copy of 1,000,000 rows: %s", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	res, err = pgoutbox.BindGroups(ctx, exec, b.tables, "fresh", []string{"relay"})
	require.NoError(t, err)
	require.EqualValues(t, 1000000, res.Adopted)
	t.Logf("adoption of 1,000,000 unbound rows into one group: %s", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "big", "a"))
	t.Logf("re-bind of a bound group on 3,000,000 rows: %s", time.Since(start).Round(time.Microsecond))
}
