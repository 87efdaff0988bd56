package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// A paused group claims nothing on either claim path while the topic's
// other group drains; a message in flight when the pause began finishes;
// publishing goes on; Stats shows the pause and the backlog; resume wakes
// the group at once (its poll interval is far longer than the wait).
func TestPauseGroupStopsItsClaims(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			exec := tx.FromPgxPool(b.Pool)
			for _, g := range []string{"a", "b"} {
				require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "t", g))
			}
			cfg := func(group string) func(*pgoutbox.SubscriberConfig) {
				return func(c *pgoutbox.SubscriberConfig) {
					c.ConsumerGroup = group
					c.ClaimMode = mode
					c.Lease = 60 * time.Second
					c.MaxPollInterval = 30 * time.Second
				}
			}
			chA, err := b.subscriber(t, cfg("a")).Subscribe(ctx, "t")
			require.NoError(t, err)
			chB, err := b.subscriber(t, cfg("b")).Subscribe(ctx, "t")
			require.NoError(t, err)
			pub := b.poolPublisher(t)

			// One message in flight in a when the pause begins.
			require.NoError(t, pub.Publish("t", newMsg("first")))
			inFlight := receive(t, chA, 5*time.Second)
			receive(t, chB, 5*time.Second).Ack()
			require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.tables, "t", "a"))
			require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.tables, "t", "a"), "pausing twice is a no-op")

			require.NoError(t, pub.Publish("t", newMsgs(5)...))
			for range 5 {
				receive(t, chB, 5*time.Second).Ack()
			}
			inFlight.Ack() // the in-flight message finishes
			require.Eventually(t, func() bool {
				s := groupStats(t, b, "t", "a")
				return s.Leased == 0 && s.Ready == 5
			}, 5*time.Second, 20*time.Millisecond, "the in-flight row is acked, the 5 new ones wait")
			s := groupStats(t, b, "t", "a")
			require.True(t, s.Paused)
			require.WithinDuration(t, time.Now(), s.PausedAt, time.Minute)
			require.False(t, groupStats(t, b, "t", "b").Paused)
			// b drained all 5 while a's subscriber polled and was woken by
			// the same publish: it claimed nothing.
			requireNothing(t, chA, 300*time.Millisecond)

			was, err := pgoutbox.ResumeGroup(ctx, exec, b.tables, "t", "a")
			require.NoError(t, err)
			require.True(t, was)
			start := time.Now()
			for range 5 {
				receive(t, chA, 5*time.Second).Ack()
			}
			require.Less(t, time.Since(start), 10*time.Second, "resume wakes the group, no 30 s poll")
			was, err = pgoutbox.ResumeGroup(ctx, exec, b.tables, "t", "a")
			require.NoError(t, err)
			require.False(t, was, "resuming a running group is a no-op")
		})
	}
}

func groupStats(t *testing.T, b *bundle, topic, group string) pgoutbox.QueueStats {
	t.Helper()
	s, err := pgoutbox.Stats(context.Background(), tx.FromPgxPool(b.Pool), b.tables, pgoutbox.StatsForGroup(topic, group))
	require.NoError(t, err)
	require.Len(t, s, 1)
	return s[0]
}

// A pause needs no binding: a group paused before it exists shows in Stats
// (an entry of its own) and in PausedGroups, and the pause survives an
// unbind.
func TestPauseWithoutBinding(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.tables, "later", "new-service"))
	all, err := pgoutbox.Stats(ctx, exec, b.tables)
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.Equal(t, "later", all[0].Topic)
	require.Equal(t, "new-service", all[0].ConsumerGroup)
	require.True(t, all[0].Paused)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings`), "pausing binds nothing")

	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "later", "new-service"))
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "later", "new-service", false)
	require.NoError(t, err)
	paused, err := pgoutbox.PausedGroups(ctx, exec, b.tables, "")
	require.NoError(t, err)
	require.Len(t, paused, 1)
	require.Equal(t, pgoutbox.PausedGroup{Topic: "later", ConsumerGroup: "new-service", PausedAt: paused[0].PausedAt}, paused[0])
}

// Every claim statement obeys a pause through one uncorrelated condition:
// an InitPlan run once, gating each branch with a One-Time Filter, so a
// paused group's claim reads no outbox row (the index scans are never
// executed) and returns what an empty group's does: no row claimed, no
// cursor, nothing free. The other group of the topic claims as usual.
func TestPauseIsOneTimeFilter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	tbl := b.Schema + ".outbox"
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s (topic, consumer_group, uuid, payload, metadata, available_at, lease_token, leased_until, lease_holder, ordering_key)
SELECT 'topic-' || (g %% 20), CASE WHEN g %% 2 = 0 THEN 'paused' ELSE 'running' END, g::text, '\x00', '{}',
       now() - interval '1 minute',
       CASE WHEN g %% 5 = 0 THEN gen_random_uuid() END,
       CASE WHEN g %% 5 = 0 THEN now() - interval '1 minute' END,
       CASE WHEN g %% 5 = 0 THEN 1 END,
       CASE WHEN g %% 3 = 0 THEN 'k' || (g %% 50) END
  FROM generate_series(1, 100000) g`, tbl))
	require.NoError(t, err)
	_, err = b.Pool.Exec(ctx, "ANALYZE "+tbl)
	require.NoError(t, err)
	exec := tx.FromPgxPool(b.Pool)
	require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.tables, "topic-3", "paused"))

	names, err := query.NewNames(b.Schema, "outbox", "")
	require.NoError(t, err)
	q := query.Build(names, true)
	lease := func(stmt, group string) []any {
		args := []any{"topic-3", 10, uuid.NewString(), int64(30e6), "test", fromStart, int64(0), fromStart, pgtype.Int8{Int64: 7, Valid: true}, group}
		switch stmt {
		case q.Claim:
			return append(args, 256, []string{"k3"}, []int64{1}, nil, false)
		case q.ClaimNoOrphans:
			return append(args, 256, []string{"k3"}, nil, false)
		case q.ClaimFast:
			return append(args, []int64{1}, nil, false)
		}
		return append(args, nil, false)
	}
	statements := []struct {
		name string
		sql  string
		args func(group string) []any
	}{
		{"Claim", q.Claim, func(g string) []any { return lease(q.Claim, g) }},
		{"ClaimNoOrphans", q.ClaimNoOrphans, func(g string) []any { return lease(q.ClaimNoOrphans, g) }},
		{"ClaimFast", q.ClaimFast, func(g string) []any { return lease(q.ClaimFast, g) }},
		{"ClaimFastNoOrphans", q.ClaimFastNoOrphans, func(g string) []any { return lease(q.ClaimFastNoOrphans, g) }},
		{"HeldClaim", q.HeldClaim, func(g string) []any { return []any{"topic-3", 10, g, fromStart, int64(0)} }},
	}
	for _, st := range statements {
		for _, group := range []string{"paused", "running"} {
			pgTx, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			text := explainAnalyze(t, pgTx, "ANALYZE, COSTS OFF, TIMING OFF", st.sql, st.args(group)...)
			// The claim's own result: claimed rows, cursor, free.
			rows, err := pgTx.Query(ctx, st.sql, st.args(group)...)
			require.NoError(t, err)
			claimed, cursors, free := 0, 0, int64(0)
			for rows.Next() {
				vals, err := rows.Values()
				require.NoError(t, err)
				if vals[0] != nil {
					claimed++
				}
				if len(vals) > 8 {
					if vals[8] != nil {
						cursors++
					}
					if f, ok := vals[10].(int64); ok {
						free += f
					}
				}
			}
			require.NoError(t, rows.Err())
			require.NoError(t, pgTx.Rollback(ctx))

			require.NotRegexp(t, `Seq Scan on outbox\b`, text, "%s, %s", st.name, group)
			if group == "running" {
				require.Positive(t, claimed, "%s claims the running group's rows:\n%s", st.name, text)
				continue
			}
			t.Logf("%s, paused:\n%s", st.name, text)
			require.Contains(t, text, "One-Time Filter", st.name)
			require.Contains(t, text, "InitPlan", st.name)
			require.Contains(t, text, names.PausedTable(), st.name)
			require.Contains(t, text, names.ReadyIdx, "%s: the plan keeps its ready branch, gated", st.name)
			// (The primary-key lookups of the empty id arrays read nothing.)
			for _, line := range strings.Split(text, "\n") {
				for _, idx := range []string{names.ReadyIdx, names.LeaseIdx, names.OrderIdx, names.OrderLeaseIdx} {
					if strings.Contains(line, " "+idx+" ") {
						require.Contains(t, line, "never executed", "%s: a paused group's claim reads no outbox row:\n%s", st.name, text)
					}
				}
			}
			require.Zero(t, claimed, st.name)
			require.Zero(t, cursors, "%s: no cursor, or the subscription would go on at once", st.name)
			require.Zero(t, free, "%s: nothing free, or the subscription would claim again at once", st.name)
		}
	}
}
