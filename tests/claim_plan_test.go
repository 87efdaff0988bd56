package tests

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// TestClaimUsesPartialIndexes pins the shape of the claim statement: on a
// table large enough for the planner to care, each branch must be an index
// scan of its own partial index, and nothing may scan the table
// sequentially. A rewrite into one "ready OR expired" SELECT, or into
// UPDATE ... FROM cte, turns into a sequential scan (see query.Claim).
// fromStart is the claim's cursor for a scan from the start of the range.
var fromStart = pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}

func TestClaimUsesPartialIndexes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tbl := b.Schema + ".outbox"
	// 20 topics x 5,000 rows; per topic a mix of ready, scheduled, live
	// leases and expired leases, the way a busy outbox looks.
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s (topic, uuid, payload, metadata, available_at, lease_token, leased_until, lease_holder)
SELECT 'topic-' || (g %% 20), g::text, '\x00', '{}',
       now() + CASE WHEN g %% 7 = 0 THEN interval '1 hour' ELSE -interval '1 minute' END,
       CASE WHEN g %% 5 = 0 THEN gen_random_uuid() END,
       CASE WHEN g %% 5 = 0 THEN now() + CASE WHEN g %% 10 = 0 THEN interval '1 minute' ELSE -interval '1 minute' END END,
       CASE WHEN g %% 5 = 0 THEN g %% 3 END
  FROM generate_series(1, 100000) g`, tbl))
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, "ANALYZE "+tbl)
	require.NoError(t, err)

	q := outboxQueries(t, b)

	// The claimer runs every claim with its generic plan (planning each
	// claim anew cost more than running it); a custom plan must keep the
	// shape too, for a claim run by hand.
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	statements := claimStatements(q, "topic-3")
	held := statements[slices.IndexFunc(statements, func(st claimStatement) bool { return st.name == "held" })]
	for _, st := range statements {
		if st.name == "held" {
			continue // below
		}
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			_, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode)
			require.NoError(t, err)
			// Every branch on: expired and orphaned leases (the orphan branch
			// reads pg_locks once, hashed) and ready rows.
			text := explain(t, conn, st.sql, st.args...)
			t.Logf("%s, %s:\n%s", st.name, mode, text)

			// (pg_database, a catalog of a few rows, may be scanned.)
			require.NotRegexp(t, `Seq Scan on outbox`, text, "the claim must not scan the table sequentially (%s, %s)", st.name, mode)
			require.Contains(t, text, q.Names.ReadyIdx, "the ready branch must use the ready-rows index (%s, %s)", st.name, mode)
			// (The check for a key's leased row may read it too, hashed.)
			require.GreaterOrEqual(t, strings.Count(text, q.Names.LeaseIdx), 2, "the expired and orphaned branches must use the leased-rows index (%s, %s)", st.name, mode)
			require.Contains(t, text, "hashed SubPlan", "the orphaned branch must read the live holders once (%s, %s)", st.name, mode)
			require.Regexp(t, `Index Cond: .*\(leased_until < now\(\)\) AND \(leased_until >= `, text,
				"the expired branch reads the lease index from its bound, not from the start (%s, %s)", st.name, mode)
			require.Contains(t, text, "outbox_pkey", "the update must find rows by primary key (%s, %s)", st.name, mode)
			require.Contains(t, text, q.Names.OrderIdx, "a keyed row's predecessor is found by the ordering-key index (%s, %s)", st.name, mode)
		}
	}
	// The held claim locks ready rows from the cursor: the ready index,
	// and a keyed row's predecessor by the ordering-key index.
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		_, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode)
		require.NoError(t, err)
		text := explain(t, conn, held.sql, held.args...)
		t.Logf("held, %s:\n%s", mode, text)
		require.NotRegexp(t, `Seq Scan on outbox`, text, "the held claim must not scan the table sequentially (%s)", mode)
		require.Contains(t, text, q.Names.ReadyIdx, "the held claim must use the ready-rows index (%s)", mode)
		require.Contains(t, text, q.Names.OrderIdx, "a keyed row's predecessor is found by the ordering-key index (%s)", mode)
	}
	_, err = conn.Exec(ctx, "RESET plan_cache_mode")
	require.NoError(t, err)
}

// claimStatement is a claim statement with arguments for EXPLAIN.
type claimStatement struct {
	name, sql string
	args      []any
}

// claimStatements are the claims of topic with every branch on: the
// windowed and the fast lease claim (expired and orphaned leases, ended
// keys), and the held claim; each from the start of the range.
func claimStatements(q *query.Queries, topic string) []claimStatement {
	lease := []any{topic, 100, uuid.NewString(), int64(30e6), "test", fromStart, int64(0), fromStart, pgtype.Int8{Int64: 7, Valid: true}, ""}
	return []claimStatement{
		{"windowed", q.Claim, append(slices.Clone(lease), 256, []string{"k1"}, []int64{1, 2}, nil, false)},
		{"fast", q.ClaimFast, append(slices.Clone(lease), []int64{1, 2}, nil, false)},
		{"fast, with a deadline", q.ClaimFast, append(slices.Clone(lease), []int64{1, 2}, time.Now().Add(time.Hour), false)},
		{"windowed, fresh only", q.Claim, append(slices.Clone(lease), 256, []string{"k1"}, []int64{1, 2}, nil, true)},
		{"fast, fresh only", q.ClaimFast, append(slices.Clone(lease), []int64{1, 2}, nil, true)},
		{"held", q.HeldClaim, q.Held(query.HeldArgs{Topic: topic, N: 100, CursorAt: fromStart})},
	}
}

// outboxQueries are the statements of the test's outbox, as a subscriber
// builds them by default (with the async-commit condition).
func outboxQueries(t *testing.T, b *bundle) *query.Queries {
	t.Helper()
	return query.Build(b.names(t), true)
}

// explainIn explains st on conn in a transaction that first runs each of
// settings, and rolls it back.
func explainIn(t *testing.T, conn *pgxpool.Conn, st claimStatement, settings ...string) string {
	t.Helper()
	return rolledBackIn(t, conn, settings, func() string { return explain(t, conn, st.sql, st.args...) })
}

// rolledBackIn returns what f returns, run on conn in a transaction that
// first runs each of settings, and rolls it back.
func rolledBackIn(t *testing.T, conn *pgxpool.Conn, settings []string, f func() string) string {
	t.Helper()
	ctx := context.Background()
	_, err := conn.Exec(ctx, "BEGIN")
	require.NoError(t, err)
	defer func() {
		_, err := conn.Exec(ctx, "ROLLBACK")
		require.NoError(t, err)
	}()
	for _, s := range settings {
		_, err := conn.Exec(ctx, s)
		require.NoError(t, err)
	}
	return f()
}

// TestClaimSettingsPlanGenericallyWithoutJIT runs the claims' EXPLAIN in a
// transaction with query.ClaimSettings, on a server that would JIT-compile
// every statement (jit_above_cost 0, standing in for a table whose claim
// costs more than the default 100,000): no JIT, and the plan is the
// generic one (parameters, not values). Without the settings the same
// EXPLAIN shows JIT, so the check can fail.
func TestClaimSettingsPlanGenericallyWithoutJIT(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	q := outboxQueries(t, b)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var jitAvailable bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_jit_available()`).Scan(&jitAvailable))

	compileAll := []string{"SET LOCAL jit = on", "SET LOCAL jit_above_cost = 0"}
	for _, st := range claimStatements(q, "t") {
		if jitAvailable {
			text := explainIn(t, conn, st, compileAll...)
			require.Contains(t, text, "JIT:", "%s: without the settings the claim is compiled:\n%s", st.name, text)
		}
		text := explainIn(t, conn, st, append(compileAll, query.ClaimSettings)...)
		require.NotContains(t, text, "JIT:", "%s: a claim is never JIT-compiled:\n%s", st.name, text)
		require.Contains(t, text, "$1", "%s: a claim runs its generic plan:\n%s", st.name, text)
	}
}

// TestClaimPlansHoldOnStaleStatistics: statistics taken while a topic had
// one ready row, then a backlog of 50,000 (autovacuum's ANALYZE comes
// later): the generic plans must still walk the ready index in its order
// and stop at the limit. Without the claim settings' scan bans a plan can
// read the whole range through a bitmap and sort it, or find the rows to
// update by a sequential scan, every claim.
func TestClaimPlansHoldOnStaleStatistics(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tbl := b.Schema + ".outbox"
	insert := func(n int) {
		_, err := b.Pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (topic, uuid, payload) SELECT 'bench', g::text, '\x00' FROM generate_series(1, %d) g`, tbl, n))
		require.NoError(t, err)
	}
	insert(1)
	_, err := b.Pool.Exec(ctx, "ANALYZE "+tbl)
	require.NoError(t, err)
	insert(50000)

	q := outboxQueries(t, b)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	statements := claimStatements(q, "bench")
	for _, st := range statements {
		text := explainIn(t, conn, st, query.ClaimSettings)
		t.Logf("%s, claim settings:\n%s", st.name, text)
		require.Contains(t, text, "Index Scan using "+q.Names.ReadyIdx, "%s: the ready index, walked in order", st.name)
		require.NotContains(t, text, "Bitmap", "%s: no bitmap over the ready range", st.name)
		require.NotRegexp(t, `Seq Scan on outbox( |$)`, text, "%s: no sequential scan of the outbox", st.name)
		require.NotRegexp(t, `Sort Key: r\.available_at, r\.id`, text, "%s: the ready rows are not sorted", st.name)
	}
	// Without the settings the generic plan here is a bitmap, a
	// sequential scan or, on some runs, the index walk itself: which one
	// depends on the table's size when the plan is made, so that
	// counterpart is not asserted (the soak showed the first two).
}

// The subscriber's own writes commit asynchronously by default
// (SynchronousCommit false): the claim sets synchronous_commit=off for its
// own transaction only. Run inside an explicit transaction, the setting is
// visible afterwards; with SynchronousCommit it stays on.
func TestSubscriberWritesCommitAsynchronously(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	names := b.names(t)
	claim := func(q interface {
		Query(context.Context, string, ...any) (pgx.Rows, error)
	}, stmt string) {
		t.Helper()
		rows, err := q.Query(ctx, stmt, "t", 1, uuid.New(), int64(30e6), "test", fromStart, int64(0), fromStart, nil, "", 256, []string{}, []int64{}, nil, false)
		require.NoError(t, err)
		claimed := 0
		for rows.Next() {
			claimed++
		}
		require.NoError(t, rows.Err())
		require.Equal(t, 1, claimed)
	}
	// One connection throughout, so a setting left on the session would show.
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	setting := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) string {
		var v string
		require.NoError(t, q.QueryRow(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&v))
		return v
	}
	for _, async := range []bool{true, false} {
		q := query.Build(names, async)
		b.publishInTx(t, "t", true, newMsg("x"))
		pgTx, err := conn.Begin(ctx)
		require.NoError(t, err)
		claim(pgTx, q.Claim)
		inTx := setting(pgTx)
		require.NoError(t, pgTx.Rollback(ctx))
		if async {
			require.Equal(t, "off", inTx)
		} else {
			require.Equal(t, "on", inTx)
		}
		// As the subscriber runs it: autocommit, the statement's own
		// transaction. The session keeps its setting.
		b.publishInTx(t, "t", true, newMsg("y"))
		claim(conn, q.Claim)
		require.Equal(t, "on", setting(conn), "the setting must not leak into the session")
	}
}

// CancelScheduled finds a key in every consumer group without reading the
// topic's other keyed rows: the dedup index is led by (topic, group), so a
// lookup by (topic, key) alone would walk the topic's whole range. With
// 60,000 keyed rows in three groups of one topic, the statement may touch
// only a few index pages per group.
func TestCancelScheduledReadsAFewPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tbl := b.Schema + ".outbox"
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s (topic, consumer_group, uuid, payload, metadata, available_at, dedup_key)
SELECT 'timers', 'g' || (g %% 3), g::text, '\x00', '{}', now() + interval '1 hour', 'key-' || (g / 3)
  FROM generate_series(0, 59999) g`, tbl))
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, "ANALYZE "+tbl)
	require.NoError(t, err)
	q := outboxQueries(t, b)

	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer pgTx.Rollback(ctx) //nolint:errcheck // the deletes must not stay
	rows, err := pgTx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+q.Cancel, "timers", "key-777")
	require.NoError(t, err)
	var plan []struct {
		Plan struct {
			SharedHit  int `json:"Shared Hit Blocks"`
			SharedRead int `json:"Shared Read Blocks"`
		} `json:"Plan"`
	}
	require.True(t, rows.Next())
	require.NoError(t, rows.Scan(&plan))
	rows.Close()
	require.NoError(t, rows.Err())
	blocks := plan[0].Plan.SharedHit + plan[0].Plan.SharedRead
	t.Logf("cancel touched %d blocks", blocks)
	require.Less(t, blocks, 100, "the cancel must look the key up per group, not scan the topic's keyed rows")

	var left int
	require.NoError(t, pgTx.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s WHERE dedup_key = 'key-777'`, tbl)).Scan(&left))
	require.Zero(t, left, "every group's copy is cancelled")
}

// A claim whose reply was lost leased rows no handler saw: ReleaseClaim
// gives them back under the claim's token, in the subscriber's group only,
// and takes back the delivery the claim counted.
func TestReleaseClaimGivesBackALostClaim(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	q := outboxQueries(t, b)
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", "a"))
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", "b"))
	b.publishInTx(t, "t", true, newMsg("x"))
	token := uuid.New()
	for _, group := range []string{"a", "b"} {
		rows, err := b.Pool.Query(ctx, q.ClaimNoOrphans, "t", 10, token, int64(30e6), "test", fromStart, int64(0), fromStart, nil, group, 256, []string{}, nil, false)
		require.NoError(t, err)
		n := 0
		for rows.Next() {
			n++
		}
		require.NoError(t, rows.Err())
		require.Equal(t, 1, n, group)
	}
	_, err := b.Pool.Exec(ctx, q.ReleaseClaim, "t", []uuid.UUID{token}, "a")
	require.NoError(t, err)
	type row struct {
		Group      string
		Leased     bool
		Deliveries int
	}
	rows, err := b.Pool.Query(ctx, `SELECT consumer_group, lease_token IS NOT NULL, deliveries FROM `+b.Schema+`.outbox ORDER BY 1`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.Equal(t, []row{{"a", false, 0}, {"b", true, 1}}, got, "a's row is back and uncounted; b's lease is b's")
}

// TestWindowedClaimProbesTheRowsItChose: the windowed claim's last step
// locks the rows its window chose, by id. Its plan must probe the primary
// key for them, never walk a ready index in order with the ids as a
// filter, which reads the whole ready range, dead entries included (on a
// partitioned outbox under a held snapshot that was 480 ms a claim, one
// after another). Checked on a partitioned outbox whose partitions have
// no statistics yet (where the walk was chosen) and on the plain table
// with stale ones, under the claim settings.
func TestWindowedClaimProbesTheRowsItChose(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()

	plain := b.Schema + ".outbox"
	_, err = b.Pool.Exec(ctx, `INSERT INTO `+plain+` (topic, uuid, payload) VALUES ('bench', 'u', '\x00')`)
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, "ANALYZE "+plain)
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, `INSERT INTO `+plain+` (topic, uuid, payload) SELECT 'bench', g::text, '\x00' FROM generate_series(1, 50000) g`)
	require.NoError(t, err)

	parted := partitionedOutbox(t, b, "_parted")
	_, err = b.Pool.Exec(ctx, `INSERT INTO `+parted+`.outbox (topic, uuid, payload) SELECT 'bench', g::text, '\x00' FROM generate_series(1, 20000) g`)
	require.NoError(t, err)

	for _, s := range []string{b.Schema, parted} {
		names, err := query.NewNames(s, "outbox", "")
		require.NoError(t, err)
		windowed := claimStatements(query.Build(names, true), "bench")[0]
		text := explainIn(t, conn, windowed, query.ClaimSettings)
		t.Logf("%s:\n%s", s, text)
		require.Empty(t, readyWalksForIDs(text), "%s: the chosen rows are probed by id, not looked for along a ready index", s)
		require.Contains(t, text, "Index Cond: (id = ANY", "%s: the chosen rows are probed by primary key", s)
	}
}

// readyWalksForIDs returns the index scans of plan text that walk a range
// of available_at (a ready index) while looking for ids given as an array.
func readyWalksForIDs(text string) []string {
	var found []string
	nodes := strings.Split(text, "->")
	for _, n := range nodes {
		head, _, _ := strings.Cut(strings.TrimSpace(n), "\n")
		if !strings.HasPrefix(head, "Index Scan") && !strings.HasPrefix(head, "Index Only Scan") {
			continue
		}
		var cond, filter string
		for _, l := range strings.Split(n, "\n") {
			l = strings.TrimSpace(l)
			if c, ok := strings.CutPrefix(l, "Index Cond: "); ok {
				cond = c
			}
			if f, ok := strings.CutPrefix(l, "Filter: "); ok {
				filter = f
			}
		}
		if strings.Contains(cond, "available_at") && strings.Contains(cond+filter, "id = ANY") {
			found = append(found, head+" / "+cond+" / "+filter)
		}
	}
	return found
}

// TestWritePlansProbeByPrimaryKey: the subscriber's writes find their rows
// by primary key under query.WriteSettings, even in a plan made while the
// outbox was empty (a subscriber started on a new outbox keeps that
// prepared plan while the table grows, until an ANALYZE). Without the
// settings that plan is a sequential scan, so the check can fail.
func TestWritePlansProbeByPrimaryKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// A new outbox of its own: a test schema may be reused, emptied.
	fresh := b.Schema + "_fresh"
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.Pool), schema.Config{Schema: fresh}))
	t.Cleanup(func() {
		_, err := b.Pool.Exec(context.Background(), `DROP SCHEMA `+fresh+` CASCADE`)
		require.NoError(t, err)
	})
	names, err := query.NewNames(fresh, "outbox", "")
	require.NoError(t, err)
	q := query.Build(names, true)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()

	ack, ackArgs := q.Write(query.CompleteArgs{})
	complete, completeArgs := q.Write(query.CompleteArgs{RetIDs: []int64{1}})
	writes := []claimStatement{
		{"ack", ack, ackArgs},
		{"ack, return and hold", complete, completeArgs},
		{"dead letter", q.Dead, make([]any, 4)},
		{"renew", q.Renew, make([]any, 4)},
	}
	generic := "SELECT set_config('plan_cache_mode', 'force_generic_plan', true)"
	without := explainIn(t, conn, writes[1], generic)
	require.Regexp(t, `Seq Scan on outbox( |$)`, without, "without the settings, a plan made on an empty outbox scans it")
	check := func(when string) {
		t.Helper()
		for _, st := range writes {
			text := explainIn(t, conn, st, generic, query.WriteSettings)
			t.Logf("%s, %s:\n%s", st.name, when, text)
			require.NotRegexp(t, `Seq Scan on outbox( |$)`, text, "%s, %s: no sequential scan of the outbox", st.name, when)
			require.NotContains(t, text, "Hash Join", "%s, %s: one probe per row", st.name, when)
			require.NotContains(t, text, "Bitmap", "%s, %s: one probe per row", st.name, when)
			require.NotContains(t, text, q.Names.LeaseIdx, "%s, %s: the rows are not looked for along the lease index", st.name, when)
			require.Contains(t, text, "using outbox_pkey on outbox", "%s, %s: rows found by primary key", st.name, when)
		}
	}
	check("empty outbox")
	// Statistics that say there are few leases: the lease index looks
	// like the cheapest way to every leased row (a soak's outbox; under a
	// held snapshot that index is mostly dead entries).
	_, err = b.Pool.Exec(ctx, `INSERT INTO `+fresh+`.outbox (topic, uuid, payload) SELECT 't', g::text, '\x00' FROM generate_series(1, 50000) g`)
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, `ANALYZE `+fresh+`.outbox`)
	require.NoError(t, err)
	check("few leases")
	// Statements that run with the session's own settings (a handler's
	// transaction, the claimer's key check): their shape alone keeps them
	// on the primary key. With "lease_token = $2" the handler's delete
	// walked the whole lease index here.
	for _, st := range []claimStatement{
		{"a handler's own completion", q.CompleteInTx, make([]any, 2)},
		{"the key check after a lease claim", q.KeyVerifyLease, make([]any, 4)},
	} {
		text := explainIn(t, conn, st, generic)
		t.Logf("%s, few leases, the session's settings:\n%s", st.name, text)
		require.Regexp(t, `Index Scan using outbox_pkey on outbox o?\s*\(cost[^\n]*\n\s+Index Cond: \(id = `, text, "%s: the row found by its id", st.name)
		if st.name == "a handler's own completion" { // the key check's subplans may read the lease index for the key
			require.NotContains(t, text, q.Names.LeaseIdx, "%s: not along the lease index", st.name)
		}
	}
	// The ack is one probe of the primary key per id, with no join: no
	// plan can take a whole index as its outer side.
	text := explainIn(t, conn, writes[0], generic, query.WriteSettings)
	require.Regexp(t, `Index Scan using outbox_pkey on outbox o[^\n]*\n\s+Index Cond: \(id = ANY `, text, "the ack probes the primary key with its ids")
	require.NotContains(t, text, "Nested Loop", "the ack joins nothing")
	// Whatever the statistics, the lease index is no way to the rows: with
	// the primary key gone (in a transaction rolled back), a write still
	// does not walk it. With "lease_token = c.token" it did.
	for _, st := range writes {
		text := explainIn(t, conn, st, generic, query.WriteSettings, `ALTER TABLE `+fresh+`.outbox DROP CONSTRAINT outbox_pkey`)
		require.NotContains(t, text, q.Names.LeaseIdx, "%s: the lease index is not a way to the rows", st.name)
	}
}

// partitionedOutbox creates, in a schema of its own (the test's schema
// with suffix), an outbox partitioned by the time a row was stored: the
// library's columns and DDL, a "long" partition below 2000-01-01 and one
// for the rest. It returns the schema, dropped when the test ends.
func partitionedOutbox(t *testing.T, b *bundle, suffix string) string {
	t.Helper()
	ctx := context.Background()
	parted := b.Schema + suffix
	for _, s := range []string{
		`CREATE SCHEMA ` + parted,
		`CREATE TABLE ` + parted + `.outbox (LIKE ` + b.Schema + `.outbox INCLUDING DEFAULTS INCLUDING IDENTITY,
    stored_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (id, stored_at)) PARTITION BY RANGE (stored_at)`,
		`CREATE TABLE ` + parted + `.outbox_long PARTITION OF ` + parted + `.outbox FOR VALUES FROM (MINVALUE) TO ('2000-01-01')`,
		`CREATE TABLE ` + parted + `.outbox_now PARTITION OF ` + parted + `.outbox FOR VALUES FROM ('2000-01-01') TO (MAXVALUE)`,
		// A unique index of a partitioned table holds the partition key.
		`CREATE UNIQUE INDEX outbox_group_dedup_idx ON ` + parted + `.outbox (topic, consumer_group, dedup_key, stored_at) WHERE dedup_key IS NOT NULL`,
	} {
		_, err := b.Pool.Exec(ctx, s)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_, err := b.Pool.Exec(context.Background(), `DROP SCHEMA `+parted+` CASCADE`)
		require.NoError(t, err)
	})
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.Pool), schema.Config{Schema: parted}))
	return parted
}

// TestKeyProbesUseTheOrderingKeyIndex: a statement that looks for a key's
// older or first row finds it through the ordering-key index, also when
// the statistics say a key is half the table (autovacuum analyzed a
// keyed backlog of a few keys). With "k.id < r.id" the generic plan walked
// the primary key from its start, filtering for the key: every probe read
// the rows before the key's first one (9 s a claim here).
func TestKeyProbesUseTheOrderingKeyIndex(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.exec(t, `INSERT INTO %s.outbox (topic, uuid, payload, ordering_key)
		SELECT 't', gen_random_uuid()::text, '\x00', 'k' FROM generate_series(0, 20000)`)
	b.exec(t, `INSERT INTO %s.outbox (topic, uuid, payload, ordering_key)
		SELECT 't', gen_random_uuid()::text, '\x00', 'hot' FROM generate_series(1, 3000)`)
	b.exec(t, `ANALYZE %s.outbox`)

	q := outboxQueries(t, b)
	conn, err := b.Pool.Acquire(context.Background())
	require.NoError(t, err)
	defer conn.Release()
	statements := append(claimStatements(q, "t"),
		claimStatement{"verify lease", q.KeyVerifyLease, []any{"t", []int64{1}, uuid.NewString(), ""}},
		claimStatement{"verify held", q.KeyVerifyHeld, []any{"t", []int64{1}, ""}})
	probe := regexp.MustCompile(`Scan using (\S+) on outbox (k|f) `)
	for _, st := range statements {
		text := explainIn(t, conn, st, query.ClaimSettings)
		probes := probe.FindAllStringSubmatch(text, -1)
		require.NotEmpty(t, probes, "%s: no probe of a key's rows in\n%s", st.name, text)
		for _, p := range probes {
			require.Equal(t, q.Names.OrderIdx, p[1], "%s: a key's rows must be found by the ordering-key index:\n%s", st.name, text)
		}
	}
}

// TestKeyedClaimProbesEachKeyOnce runs the windowed claim on a backlog of
// two keys, 2,000 rows each, interleaved, with both keys ended, and counts
// the looks for a key's older row: the window's (one for the oldest row of
// each key in it, not one a row: the others have it as an older row) and
// the one finding each ended key's first row (a probe from that row's id,
// not a walk of the key's rows compared one by one: planned as an anti
// join it read every row of the key, 130 ms a claim at 10,000 rows a key).
// On the outbox as created and after ANALYZE.
func TestKeyedClaimProbesEachKeyOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.exec(t, `INSERT INTO %s.outbox (topic, uuid, payload, ordering_key)
		SELECT 't', gen_random_uuid()::text, '\x00', CASE WHEN g % 2 = 0 THEN 'a' ELSE 'b' END FROM generate_series(1, 4000) g`)
	q := outboxQueries(t, b)
	conn, err := b.Pool.Acquire(context.Background())
	require.NoError(t, err)
	defer conn.Release()
	args := []any{"t", 100, uuid.NewString(), int64(30e6), "test", fromStart, int64(0), nil, pgtype.Int8{Int64: 7, Valid: true}, "", 256, []string{"a", "b"}, []int64{1, 2}, nil, false}
	probe := regexp.MustCompile(`on outbox (k\S*) .*\(actual time=\S+ rows=(\d+) loops=(\d+)\)`)
	for _, analyzed := range []bool{false, true} {
		if analyzed {
			b.exec(t, `ANALYZE %s.outbox`)
		}
		plan := rolledBackIn(t, conn, []string{query.ClaimSettings}, func() string {
			return explainAnalyze(t, conn, "ANALYZE, BUFFERS", q.Claim, args...)
		})
		probes := probe.FindAllStringSubmatch(plan, -1)
		require.Len(t, probes, 2, "analyzed %v: the window's and the ended keys' looks for an older row in\n%s", analyzed, plan)
		for _, p := range probes {
			require.Contains(t, []string{"0", "1"}, p[2], "analyzed %v: a look for an older row stops at the first it meets:\n%s", analyzed, plan)
			require.Contains(t, []string{"1", "2"}, p[3], "analyzed %v: one look a key:\n%s", analyzed, plan)
		}
		require.Contains(t, plan, "rows=2 loops=1", "analyzed %v: the claim takes both keys' first rows:\n%s", analyzed, plan)
	}
}

// TestTransferPlansWalkTheArrivalsKey explains the fan-out of arrivals
// (query.ArrivalsStatements.Transfer) as the claimer runs it, with
// query.ClaimSettings and its generic plan, on a busy arrivals table: it
// reads the topic's arrivals through the arrivals' key in its order and
// deletes them by it, never scanning a table sequentially.
func TestTransferPlansWalkTheArrivalsKey(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx := context.Background()
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s.outbox_arrivals (topic, uuid, payload)
SELECT 'topic-' || (g %% 20), g::text, '\x00' FROM generate_series(1, 100000) g`, b.Schema))
	require.NoError(t, err)
	for _, g := range []string{"g1", "g2", "g3"} {
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "topic-3", g))
	}
	_, err = b.Pool.Exec(ctx, "ANALYZE "+b.Schema+".outbox_arrivals")
	require.NoError(t, err)

	q := query.Build(b.names(t).WithArrivals(), true)
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	st := claimStatement{"transfer", q.Arrivals.Transfer, []any{"topic-3", "g1", 256, "channel"}}
	text := explainIn(t, conn, st, query.ClaimSettings)
	t.Logf("transfer:\n%s", text)
	require.Contains(t, text, "$1", "the fan-out must run its generic plan")
	require.NotContains(t, text, "Seq Scan", "the fan-out must not scan a table sequentially")
	require.GreaterOrEqual(t, strings.Count(text, "outbox_arrivals_pkey"), 2, "the fan-out must pick and delete arrivals by their key")
}
