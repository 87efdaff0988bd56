package tests

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// rotatingSetup is setup for a rotating outbox. Its subscribers rotate
// once an hour: the tests call schema.Rotate themselves, step by step.
func rotatingSetup(t *testing.T) *bundle {
	t.Helper()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true, MaxConns: 20})
	require.True(t, env.Tables.Rotating)
	// Longer than a lock autovacuum holds before it gives way (1 s), so
	// that a TRUNCATE the test expects is not missed on a busy server.
	testhook.SetRotateLockTimeout(qtable(env.Schema), 3*time.Second)
	// The tests' windows are microseconds: a stuck partition is three of
	// them, not the half minute at least of a real outbox.
	testhook.SetRotateStuckAfter(qtable(env.Schema), time.Nanosecond)
	t.Cleanup(func() {
		testhook.SetRotateLockTimeout(qtable(env.Schema), 0)
		testhook.SetRotateStuckAfter(qtable(env.Schema), 0)
	})
	return &bundle{Env: env, tables: env.Tables, logger: watermill.NewStdLogger(false, false)}
}

// qtable is the quoted name of the outbox of schema s.
func qtable(s string) string { return pgx.Identifier{s, "outbox"}.Sanitize() }

func (b *bundle) rotate(t *testing.T, window time.Duration) schema.RotateResult {
	t.Helper()
	res, err := schema.Rotate(context.Background(), tx.FromPgxPool(b.Pool), b.tables, window)
	require.NoError(t, err)
	require.False(t, res.Busy)
	return res
}

// generationOf is the partition holding the rows of topic (one name, or
// "" without rows; several partitions fail the test).
func (b *bundle) generationOf(t *testing.T, topic string) string {
	t.Helper()
	var parts []string
	rows, err := b.Pool.Query(context.Background(), `SELECT DISTINCT c.relname::text FROM `+b.Schema+`.outbox o JOIN pg_class c ON c.oid = o.tableoid WHERE o.topic = $1`, topic)
	require.NoError(t, err)
	parts, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.LessOrEqual(t, len(parts), 1, "rows of %s in several partitions: %v", topic, parts)
	if len(parts) == 0 {
		return ""
	}
	return parts[0]
}

func (b *bundle) relationSize(t *testing.T, rel string) int64 {
	t.Helper()
	var size int64
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT pg_relation_size(c.oid) FROM pg_class c WHERE c.relname = $1 AND c.relnamespace = $2::regnamespace`, rel, b.Schema).Scan(&size))
	return size
}

// consumeAll receives n messages of topic, acks them, and waits until the
// outbox has none of them left.
func consumeAll(t *testing.T, b *bundle, topic string, n int) map[string]bool {
	t.Helper()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.RotationWindow = time.Hour })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := ackAll(t, ch, n)
	require.Eventually(t, func() bool { return b.outboxRows(t, topic) == 0 }, 10*time.Second, 10*time.Millisecond)
	return got
}

// ackAll receives and acks messages from ch until it has had n distinct
// ones, and returns their UUIDs.
func ackAll(t *testing.T, ch <-chan *message.Message, n int) map[string]bool {
	t.Helper()
	got := map[string]bool{}
	for len(got) < n {
		m := receive(t, ch, 10*time.Second)
		got[m.UUID] = true
		m.Ack()
	}
	return got
}

// The point of a rotating outbox: with a snapshot held elsewhere (which
// keeps vacuum from removing anything the outbox deletes), a partition
// whose rows were all consumed is truncated, and its space is free.
func TestRotatingOutboxFreesConsumedRowsUnderAHeldSnapshot(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()

	holder, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	held, err := holder.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer held.Rollback(ctx) //nolint:errcheck // ends the snapshot
	var one int
	require.NoError(t, held.QueryRow(ctx, `SELECT 1 FROM pg_class LIMIT 1`).Scan(&one)) // takes the snapshot

	first := b.generationName(t, 0)
	require.NoError(t, b.poolPublisher(t).Publish("rot.held", newMsgs(200)...))
	require.Equal(t, first, b.generationOf(t, "rot.held"))
	require.Len(t, consumeAll(t, b, "rot.held", 200), 200)
	require.Positive(t, b.relationSize(t, first), "the consumed rows are still on disk: the snapshot keeps them")

	res := b.rotate(t, time.Hour)
	require.True(t, res.Advanced, "a partition whose rows are all consumed gives way at once: %+v", res)
	res = b.rotate(t, time.Hour)
	require.Equal(t, []string{first}, res.Truncated, "%+v", res)
	require.Zero(t, b.relationSize(t, first), "truncated while the snapshot is held")

	// New rows go to the next partition and are delivered as before.
	require.NoError(t, b.poolPublisher(t).Publish("rot.held", newMsgs(3)...))
	require.Equal(t, b.generationName(t, 0), b.generationOf(t, "rot.held"), "the ring advanced")
	require.Len(t, consumeAll(t, b, "rot.held", 3), 3)
}

// generationName is the partition of generation g, offset generations
// after the current one (the test schemas are reused, and their ring has
// turned).
func (b *bundle) generationName(t *testing.T, offset int) string {
	t.Helper()
	if offset == 3 {
		return "outbox_long"
	}
	cur := b.count(t, `SELECT (pg_sequence_last_value('`+b.Schema+`.outbox_generation') % 3)::int`)
	return fmt.Sprintf("outbox_g%d", (cur+offset)%3)
}

// A publisher that read the generation before the ring advanced commits
// into the partition the ring left. Its row is never truncated: not while
// its transaction is open (the TRUNCATE cannot get its lock), and not when
// it commits while the TRUNCATE waits (the partition is checked again
// under the lock).
func TestRotateNeverTruncatesARowCommittedIntoTheLeftPartition(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	first := b.generationName(t, 0)

	// Rows stored and consumed, so the first partition has taken rows.
	require.NoError(t, b.poolPublisher(t).Publish("rot.late", newMsgs(2)...))
	consumeAll(t, b, "rot.late", 2)

	late, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer late.Rollback(ctx) //nolint:errcheck // committed below
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(late), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
	require.NoError(t, err)
	lateMsg := newMsg("late")
	require.NoError(t, pub.Publish("rot.late", lateMsg))

	require.True(t, b.rotate(t, time.Hour).Advanced)
	res := b.rotate(t, time.Hour)
	require.Empty(t, res.Truncated, "the open transaction's row is in %s", first)
	require.Equal(t, 1, res.LockTimeouts, "%+v", res)

	// Now the TRUNCATE waits for its lock, and the row commits meanwhile.
	testhook.SetRotateLockTimeout(qtable(b.Schema), time.Minute)
	done := make(chan schema.RotateResult, 1)
	go func() {
		r, err := schema.Rotate(ctx, tx.FromPgxPool(b.Pool), b.tables, time.Hour)
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_locks WHERE relation = (SELECT oid FROM pg_class WHERE relname = $1 AND relnamespace = $2::regnamespace) AND mode = 'AccessExclusiveLock' AND NOT granted`, first, b.Schema) == 1
	}, 10*time.Second, time.Millisecond, "the TRUNCATE waits for the publisher's lock")
	require.NoError(t, late.Commit(ctx))
	res = <-done
	require.Empty(t, res.Truncated, "%+v", res)
	require.Equal(t, first, b.generationOf(t, "rot.late"))
	got := consumeAll(t, b, "rot.late", 1)
	require.True(t, got[lateMsg.UUID])

	require.Equal(t, []string{first}, b.rotate(t, time.Hour).Truncated, "consumed at last")
}

// Rows that outlive a turn of the ring leave it: keyed rows are stored
// outside it from the start (their dedup key stays unique however the ring
// turns), timers move out when their partition drains, and a partition
// left with rows nobody consumes for three windows gives them up too.
func TestRotateMovesRowsThatOutliveTheRing(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	long, first := b.generationName(t, 3), b.generationName(t, 0)

	keyed := newMsg("keyed")
	pgoutbox.WithDedupKey(keyed, "k1")
	pgoutbox.DeliverAfter(keyed, time.Hour)
	require.NoError(t, pub.Publish("rot.keyed", keyed))
	require.Equal(t, long, b.generationOf(t, "rot.keyed"))

	timer := newMsg("timer")
	pgoutbox.DeliverAfter(timer, 2*time.Hour)
	require.NoError(t, pub.Publish("rot.timer", timer))
	require.NoError(t, pub.Publish("rot.unread", newMsg("nobody reads me")))
	require.Equal(t, first, b.generationOf(t, "rot.timer"))

	// A window of a microsecond is over at once: the ring advances. With
	// an hour's window the next step only moves what is due later than
	// that: the timer, not the unread row (due now).
	require.True(t, b.rotate(t, time.Microsecond).Advanced)
	res := b.rotate(t, time.Hour)
	require.EqualValues(t, 1, res.Moved, "the timer only: %+v", res)
	require.False(t, res.Advanced)
	require.Equal(t, long, b.generationOf(t, "rot.timer"))
	require.Equal(t, first, b.generationOf(t, "rot.unread"))

	// The ring turns once more, and the unread row's partition is next:
	// it holds the ring up until, three windows after the advance, the
	// row leaves the ring and the partition is truncated.
	require.True(t, b.rotate(t, time.Microsecond).Advanced)
	require.Eventually(t, func() bool {
		res = b.rotate(t, time.Microsecond)
		return res.Moved > 0
	}, 10*time.Second, time.Millisecond)
	require.EqualValues(t, 1, res.Moved, "%+v", res)
	require.Equal(t, long, b.generationOf(t, "rot.unread"))
	require.Equal(t, []string{first}, res.Truncated, "%+v", res)

	// The dedup key still holds: a second message with it is skipped.
	again := newMsg("keyed again")
	pgoutbox.WithDedupKey(again, "k1")
	r, err := pub.PublishWithResult("rot.keyed", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, r.Skipped())
	ok, err := pub.CancelScheduled(ctx, "rot.keyed", "k1")
	require.NoError(t, err)
	require.True(t, ok)

	// Rows moved out of the ring are delivered as any other.
	got := consumeAll(t, b, "rot.unread", 1)
	require.Len(t, got, 1)
}

// The Subscriber rotates a rotating outbox by itself while it has a
// subscription, on each claim path: a steady stream through short windows
// leaves the ring turning, its drained partitions truncated (while held
// batches and leases come and go), and every message delivered.
func TestSubscriberRotatesItsOutbox(t *testing.T) {
	onEachClaimMode(t, testSubscriberRotates)
}

func testSubscriberRotates(t *testing.T, mode pgoutbox.ClaimMode) {
	b := rotatingSetup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RotationWindow = 100 * time.Millisecond
		c.MaxInFlight = 4
		c.ClaimMode = mode
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, "rot.steady")
	require.NoError(t, err)
	filesBefore := b.filenodes(t)
	pub := b.poolPublisher(t)
	sent := map[string]bool{}
	got := map[string]bool{}
	current := `SELECT (pg_sequence_last_value('` + b.Schema + `.outbox_generation') % 3)::int`
	last, turns := b.count(t, current), 0
	for round := 0; turns < 4; round++ {
		require.Less(t, round, 2000, "the ring did not turn")
		if now := b.count(t, current); now != last {
			last, turns = now, turns+1
		}
		msgs := newMsgs(5)
		for _, m := range msgs {
			sent[m.UUID] = true
		}
		require.NoError(t, pub.Publish("rot.steady", msgs...))
		for range msgs {
			m := receive(t, ch, 10*time.Second)
			got[m.UUID] = true
			m.Ack()
		}
	}
	require.Equal(t, sent, got)
	// TRUNCATE gives a partition a new file: some partition's changed
	// since the test began (an empty one proves nothing: the test schemas
	// are reused, and a partition may never have been written).
	require.Eventually(t, func() bool {
		return b.filenodes(t) != filesBefore
	}, 10*time.Second, 10*time.Millisecond, "a drained partition is truncated")
}

// Publishers and subscribers of one outbox must agree on its layout: a
// subscriber that does not know the outbox rotates (or thinks a single
// table does) refuses to start, saying what to set.
func TestSubscriberRefusesAMismatchedRotatingSetting(t *testing.T) {
	t.Parallel()
	ring := rotatingSetup(t)
	single := setup(t)
	for _, c := range []struct {
		b    *bundle
		flip bool
		want string
	}{
		{ring, false, "is a rotating outbox; set Rotating"},
		{single, true, "is a single table, not a rotating outbox"},
	} {
		tables := c.b.tables
		tables.Rotating = c.flip
		err := schema.Validate(context.Background(), tx.FromPgxPool(c.b.Pool), tables)
		require.ErrorContains(t, err, c.want)
		require.ErrorContains(t, schema.Create(context.Background(), tx.FromPgxPool(c.b.Pool), tables), c.want)
		sub, err := pgoutbox.NewSubscriber(c.b.Pool, pgoutbox.SubscriberConfig{Tables: tables}, nil)
		require.NoError(t, err)
		_, err = sub.Subscribe(context.Background(), "rot.mismatch")
		require.ErrorContains(t, err, c.want)
		require.NoError(t, sub.Close())
	}
	require.NoError(t, schema.Validate(context.Background(), tx.FromPgxPool(ring.Pool), ring.tables))
}

// filenodes lists the files of the ring's partitions.
func (b *bundle) filenodes(t *testing.T) string {
	t.Helper()
	var files string
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT string_agg(relname || '=' || pg_relation_filenode(oid), ',' ORDER BY relname)
  FROM pg_class WHERE relnamespace = $1::regnamespace AND relname LIKE 'outbox_g_'`, b.Schema).Scan(&files))
	return files
}

// The operator page's rates read the outbox's insert and delete counters:
// for a rotating outbox, the sums of its partitions' (the partitioned
// table counts nothing itself).
func TestTableCountersOfARotatingOutboxSumItsPartitions(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	counters := func() (ins, del int64) {
		require.NoError(t, b.Pool.QueryRow(ctx, query.UITableCounters, qtable(b.Schema)).Scan(&ins, &del))
		return ins, del
	}
	ins0, del0 := counters() // the test schemas are reused
	require.NoError(t, b.poolPublisher(t).Publish("rot.counted", newMsgs(30)...))
	require.Len(t, consumeAll(t, b, "rot.counted", 30), 30)
	// Backends report their counts at the end of a transaction, at most
	// once a second, and an idle one about ten seconds later.
	pollUntil(t, "30 rows inserted and 30 deleted are counted", 30*time.Second, nil, func() bool {
		ins, del := counters()
		return ins-ins0 >= 30 && del-del0 >= 30
	})
}

// The grants docs/rotation.md adds to the single table's are enough: a
// publisher role publishes plain and keyed messages into a rotating
// outbox, and a subscriber role consumes them and turns the ring.
func TestRotatingOutboxWithTheDocumentedGrants(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	pubPool := b.loginRole(t, "pub", append(slices.Clip(publisherGrants),
		`GRANT SELECT ON SEQUENCE %s.outbox_generation TO %r`,
		`GRANT SELECT (generation) ON %s.outbox TO %r`)...)
	subPool := b.loginRole(t, "sub", append(slices.Clip(subscriberGrants),
		`GRANT SELECT, UPDATE ON SEQUENCE %s.outbox_generation TO %r`,
		`GRANT SELECT, UPDATE, TRUNCATE ON %s.outbox_g0, %s.outbox_g1, %s.outbox_g2 TO %r`)...)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
	require.NoError(t, err)
	keyed := newMsg("keyed")
	pgoutbox.WithDedupKey(keyed, "once")
	require.NoError(t, pub.Publish("rot.grants", append(newMsgs(20), keyed)...))
	again := newMsg("keyed again")
	pgoutbox.WithDedupKey(again, "once")
	res, err := pub.PublishWithResult("rot.grants", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped())

	filesBefore := b.filenodes(t)
	sub := b.subscriberOn(t, subPool, func(c *pgoutbox.SubscriberConfig) { c.RotationWindow = 100 * time.Millisecond })
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := sub.Subscribe(subCtx, "rot.grants")
	require.NoError(t, err)
	ackAll(t, ch, 21)
	require.Eventually(t, func() bool { return b.filenodes(t) != filesBefore }, 20*time.Second, 10*time.Millisecond,
		"the subscriber role turns the ring and truncates a drained partition")
}

// A rotation step beside an open held batch: the batch locks every
// partition (a claim names the partitioned table), so the TRUNCATE of a
// drained partition waits for it; the step then empties only that
// partition, and the held message, in another, is acked afterwards and not
// delivered again.
func TestRotateBesideAHeldBatch(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	drained := b.generationName(t, 0)
	require.NoError(t, b.poolPublisher(t).Publish("rot.drained", newMsgs(20)...))
	require.Len(t, consumeAll(t, b, "rot.drained", 20), 20)
	require.True(t, b.rotate(t, time.Microsecond).Advanced)
	heldIn := b.generationName(t, 0)
	require.NotEqual(t, drained, heldIn)
	require.NoError(t, b.poolPublisher(t).Publish("rot.held-batch", newMsg("held")))

	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		onPath(t, testhook.PathHeld, c) // the first claims too
		c.RotationWindow = time.Hour
	})
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := sub.Subscribe(subCtx, "rot.held-batch")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	// The batch stays open for at most its bound (then its row becomes a
	// lease): whether the first step met it depends on the machine.
	t.Logf("held batch open at the first step: %v", b.count(t, `SELECT count(*) FROM pg_locks
 WHERE relation = $1::regclass AND granted AND pid <> pg_backend_pid()`, b.Schema+"."+drained) > 0)

	// Steps until the drained partition is truncated (a reused schema's
	// other partition may go first: one TRUNCATE a step).
	var truncated []string
	for range 3 {
		res := b.rotate(t, time.Hour)
		truncated = append(truncated, res.Truncated...)
		if slices.Contains(truncated, drained) {
			break
		}
	}
	require.Contains(t, truncated, drained)
	require.NotContains(t, truncated, heldIn, "the partition of the held message is not truncated")
	require.Zero(t, b.relationSize(t, drained))
	require.Equal(t, heldIn, b.generationOf(t, "rot.held-batch"), "the message in hand is still there")

	m.Ack()
	select {
	case <-m.Acked():
	case <-time.After(10 * time.Second):
		t.Fatal("the held message was not acked")
	}
	require.Eventually(t, func() bool { return b.outboxRows(t, "rot.held-batch") == 0 }, 10*time.Second, 10*time.Millisecond)
	requireNothing(t, ch, 300*time.Millisecond)
}

// Ordering keys hold across the ring's partitions, on each claim path: a
// delayed head of a key moves out of the ring (it is due after the next
// window) while the later message of its key stays in the ring, and the
// later one still waits for it.
func TestOrderingKeysAcrossTheRing(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := rotatingSetup(t)
		first, second, other := delayedHeadMsgs(3 * time.Second)
		require.NoError(t, b.poolPublisher(t).Publish("rot.ordered", first, second, other))
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 4
			c.RotationWindow = 50 * time.Millisecond
		})
		ch, err := sub.Subscribe(context.Background(), "rot.ordered")
		require.NoError(t, err)
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, "b1", string(m.Payload))
		m.Ack()
		partitionOf := func(uuid string) string {
			var rel string
			require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT c.relname::text FROM `+b.Schema+`.outbox o
  JOIN pg_class c ON c.oid = o.tableoid WHERE o.uuid = $1`, uuid).Scan(&rel))
			return rel
		}
		pollUntil(t, "the delayed head left the ring", 2500*time.Millisecond, nil, func() bool { return partitionOf(first.UUID) == "outbox_long" })
		require.NotEqual(t, "outbox_long", partitionOf(second.UUID), "the later message of the key is still in the ring")
		for _, want := range []string{"a1 delayed", "a2"} {
			m := receive(t, ch, 10*time.Second)
			require.Equal(t, want, string(m.Payload), "the key's order holds across partitions")
			m.Ack()
		}
	})
}

// Consumer groups on a rotating outbox: the first groups bound adopt what
// was published before them, each getting its copies, the keyed ones in
// the long partition (where every copy's key stays unique), and a dedup
// key then holds per group.
func TestGroupsAdoptTheBacklogOfARotatingOutbox(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	timer := newMsg("timer")
	pgoutbox.WithDedupKey(timer, "remind-7")
	pgoutbox.DeliverAfter(timer, time.Hour)
	b.publishInTx(t, "rot.groups", true, append(newMsgs(5), timer)...)

	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "rot.groups", []string{"a", "b"})
	require.NoError(t, err)
	require.EqualValues(t, 6, res.Adopted)
	for _, g := range []string{"a", "b"} {
		require.Equal(t, 6, b.groupRows(t, "rot.groups", g), g)
	}
	require.Zero(t, b.groupRows(t, "rot.groups", ""))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox o JOIN pg_class c ON c.oid = o.tableoid
 WHERE o.dedup_key = 'remind-7' AND c.relname = 'outbox_long'`), "every group's keyed copy in the long partition")

	again := newMsg("again")
	pgoutbox.WithDedupKey(again, "remind-7")
	r, err := b.poolPublisher(t).PublishWithResult("rot.groups", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, r.Skipped(), "the key holds for both groups")
	ok, err := b.poolPublisher(t).CancelScheduled(ctx, "rot.groups", "remind-7")
	require.NoError(t, err)
	require.True(t, ok)
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE dedup_key = 'remind-7'`))
}

// A Subscriber rotates while it has a subscription: when the last one
// ends by its context (as a Router's cancelled Run ends them, without
// closing the subscriber, and the pool may be closed next) the rotator
// stops, and the next Subscribe starts it again.
func TestSubscriberRotatesOnlyWhileItHasASubscription(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.RotationWindow = 50 * time.Millisecond })
	generation := func() int {
		return b.count(t, `SELECT pg_sequence_last_value('`+b.Schema+`.outbox_generation')`)
	}
	turns := func() {
		t.Helper()
		start := generation()
		pollUntil(t, "the ring turns", 10*time.Second, nil, func() bool { return generation() > start+1 })
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, "rot.life")
	require.NoError(t, err)
	turns()
	cancel()
	for range ch { // closed once the subscription ended
	}
	stopped := generation()
	time.Sleep(20 * 50 * time.Millisecond) // twenty windows: a running rotator advances the ring in each
	require.LessOrEqual(t, generation(), stopped+1, "the ring turned without a subscription (a step under way may finish)")

	ch, err = sub.Subscribe(context.Background(), "rot.life")
	require.NoError(t, err)
	turns()
	require.NoError(t, sub.Close())
	for range ch {
	}
}

// Rotate told that a single table rotates says so, and what to do.
func TestRotateOnASingleTableSaysWhatToDo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.tables
	c.Rotating = true
	_, err := schema.Rotate(context.Background(), tx.FromPgxPool(b.Pool), c, 0)
	require.ErrorIs(t, err, schema.ErrNotRotating)
	require.ErrorContains(t, err, "unset Config.Rotating")
}

// Health shows a rotating outbox's ring: the partition new rows go to, for
// how long, and each partition's rows (estimates, as the backends report
// them); a single table has none.
func TestHealthShowsTheRing(t *testing.T) {
	t.Parallel()
	b := rotatingSetup(t)
	ctx := context.Background()
	h, err := pgoutbox.Health(ctx, tx.FromPgxPool(b.Pool), b.tables)
	require.NoError(t, err)
	require.NotNil(t, h.Ring)
	require.Contains(t, []int{0, 1, 2}, h.Ring.Current)
	require.GreaterOrEqual(t, h.Ring.CurrentFor, time.Duration(0))
	require.Less(t, h.Ring.CurrentFor, 24*time.Hour)

	// Nobody rotates here: the rows stay in the current partition.
	require.NoError(t, b.poolPublisher(t).Publish("rot.health", newMsgs(20)...))
	pollUntil(t, "the current partition's rows are counted", 30*time.Second, nil, func() bool {
		h, err = pgoutbox.Health(ctx, tx.FromPgxPool(b.Pool), b.tables)
		require.NoError(t, err)
		return h.Ring.Rows[h.Ring.Current] >= 20
	})

	single := setup(t)
	h, err = pgoutbox.Health(ctx, tx.FromPgxPool(single.Pool), single.tables)
	require.NoError(t, err)
	require.Nil(t, h.Ring)
}
