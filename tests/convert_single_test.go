package tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Converting a rotating outbox back to a single table while it is in use,
// on each claim mode: a subscriber of the rotating outbox keeps a message
// of the ring in hand across the conversion and acks it after; the
// backlog in the ring, a timer and its dedup key in the long partition
// stay; roles granted the single table's documented privileges on the
// rotating outbox publish and consume the single table.
func TestConvertToSingleKeepsAnOutboxInUse(t *testing.T) {
	onEachClaimMode(t, testConvertBackInUse)
}

func testConvertBackInUse(t *testing.T, mode pgoutbox.ClaimMode) {
	ring := rotatingSetup(t)
	single := *ring
	single.tables.Rotating = false
	ctx := context.Background()
	pubPool := ring.loginRole(t, "pub", publisherGrants...)
	subPool := ring.loginRole(t, "sub", subscriberGrants...)

	pub := ring.poolPublisher(t)
	maxBefore := ring.publishBeforeConversion(t, pub, "back")
	require.Equal(t, ring.generationName(t, 0), ring.generationOf(t, "back.backlog"))
	held := ring.holdOne(t, mode, "back.backlog")

	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(ring.Pool), ring.tables))

	isRot, err := schema.IsRotating(ctx, tx.FromPgxPool(ring.Pool), ring.tables)
	require.NoError(t, err)
	require.False(t, isRot)
	require.NoError(t, schema.Validate(ctx, tx.FromPgxPool(ring.Pool), single.tables))
	require.ErrorContains(t, schema.Validate(ctx, tx.FromPgxPool(ring.Pool), ring.tables), "is a single table, not a rotating outbox")
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(ring.Pool), single.tables), "converting again does nothing")
	require.Zero(t, ring.count(t, `SELECT count(*) FROM pg_class WHERE relnamespace = $1::regnamespace
   AND relname IN ('outbox_g0', 'outbox_g1', 'outbox_g2', 'outbox_long', 'outbox_generation')`, ring.Schema),
		"the ring, its sequence and the long partition's name are gone")

	// The subscriber that ran across the conversion acks what it held and
	// goes on with the backlog, now in the single table.
	held.ackAndTakeNine(t)
	require.Equal(t, 30, single.outboxRows(t, "back.backlog"), "acks across the conversion removed their rows")

	// A publisher still on the rotating setting publishes plain messages;
	// its keyed ones fail (they name the generation).
	require.NoError(t, pub.Publish("back.old", newMsg("old setting")))
	oldKeyed := newMsg("old setting, keyed")
	pgoutbox.WithDedupKey(oldKeyed, "daily-report")
	require.Error(t, pub.Publish("back.timer", oldKeyed))

	// The roles publish and consume the single table with what the
	// rotating outbox granted them; ids go on, and the timer's key holds.
	spub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: single.tables}, single.logger)
	require.NoError(t, err)
	require.NoError(t, spub.Publish("back.fresh", newMsgs(20)...))
	require.Greater(t, single.count(t, `SELECT min(id)::int FROM `+single.Schema+`.outbox WHERE topic = 'back.fresh'`), maxBefore)
	again := newMsg("timer again")
	pgoutbox.WithDedupKey(again, "daily-report")
	res, err := spub.PublishWithResult("back.timer", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped(), "a dedup key published before the conversion still holds")

	sub := single.subscriberOn(t, subPool, func(c *pgoutbox.SubscriberConfig) { c.ClaimMode = mode })
	subCtx, stop := context.WithCancel(ctx)
	defer stop()
	for topic, want := range map[string]int{"back.backlog": 30, "back.fresh": 20, "back.old": 1} {
		ch, err := sub.Subscribe(subCtx, topic)
		require.NoError(t, err)
		ackAll(t, ch, want)
	}
	require.Eventually(t, func() bool {
		return single.outboxRows(t, "back.backlog")+single.outboxRows(t, "back.fresh")+single.outboxRows(t, "back.old") == 0
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, single.outboxRows(t, "back.timer"), "the timer waits for its hour")
}

// The single table a rotating outbox becomes is the one Create makes:
// the same columns, indexes, constraints, storage parameters and owners,
// whether Create made the outbox rotating or converted a single table;
// an index of the user's own keeps its name.
func TestConvertToSingleMakesCreatesLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	want := setup(t).layout(t)

	made := rotatingSetup(t)
	require.NoError(t, made.poolPublisher(t).Publish("back.layout", newMsgs(5)...))
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(made.Pool), made.tables))
	require.Equal(t, want, made.layout(t))
	require.Equal(t, 5, made.outboxRows(t, "back.layout"))
	single := made.tables
	single.Rotating = false
	steps, err := schema.Migrate(ctx, tx.FromPgxPool(made.Pool), single, schema.Latest)
	require.NoError(t, err, "the versioned migrations take the single table up from where Create left it")
	require.Empty(t, steps, "at the latest version already")

	there := setup(t)
	_, err = there.Pool.Exec(ctx, `CREATE INDEX by_uuid ON `+there.Schema+`.outbox (uuid)`)
	require.NoError(t, err)
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(there.Pool), there.tables))
	_, err = there.Pool.Exec(ctx, `CREATE INDEX by_created ON `+there.Schema+`.outbox (created_at)`)
	require.NoError(t, err)
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(there.Pool), there.tables))
	got := there.layout(t)
	require.Contains(t, got, "index CREATE INDEX by_created ON SCHEMA.outbox USING btree (created_at)", "an index made on the rotating outbox")
	require.Contains(t, got, "index CREATE INDEX by_uuid ON SCHEMA.outbox USING btree (uuid)", "an index of the single table before")
	var rest []string
	for _, l := range got {
		if l != "index CREATE INDEX by_created ON SCHEMA.outbox USING btree (created_at)" && l != "index CREATE INDEX by_uuid ON SCHEMA.outbox USING btree (uuid)" {
			rest = append(rest, l)
		}
	}
	require.Equal(t, want, rest, "there and back is the single table Create makes")
}

// A conversion back interrupted part way (the ring stopped, some rows
// moved, a cancelled index build) goes on from where it stopped; rows a
// claim holds in the ring are skipped by the moves and moved under the
// lock once the claim's transaction ends.
func TestConvertToSingleGoesOnFromWhereItStopped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := rotatingSetup(t)
	require.NoError(t, b.poolPublisher(t).Publish("back.resumed", newMsgs(10)...))
	_, q := b.singleConversion(t)
	b.exec(t, q.StopRing)
	// A claim holds one ring row while the moves run: they skip it.
	held, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = held.Rollback(ctx) }) // a failed require leaves no transaction for an index build to wait on
	var heldID int64
	var gen int
	// A reused schema's ring may have turned: the rows are wherever the
	// current generation is.
	require.NoError(t, held.QueryRow(ctx, `SELECT id, generation FROM `+b.Schema+`.outbox WHERE topic = 'back.resumed' ORDER BY id LIMIT 1 FOR UPDATE`).Scan(&heldID, &gen))
	require.Less(t, gen, 3, "published into the ring")
	b.exec(t, q.MoveOut[gen])
	require.Equal(t, []string{fmt.Sprintf("outbox_g%d", gen)}, column[string](t, b, `SELECT tableoid::regclass::text FROM `+b.Schema+`.outbox WHERE topic = 'back.resumed' AND generation < 3`),
		"the held row stays in the ring")
	require.Equal(t, 9, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_long WHERE topic = 'back.resumed'`))
	require.NoError(t, held.Rollback(ctx)) // an index build waits for every older transaction
	b.exec(t, q.Prepared[0])
	b.exec(t, q.StopRing)
	// What a cancelled CREATE INDEX CONCURRENTLY leaves.
	_, err = b.Pool.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass`, b.Schema+"."+q.PreparedNames[0])
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("back.after", newMsg("after the ring stopped")))
	require.Equal(t, "outbox_long", b.generationOf(t, "back.after"), "plain inserts go to the long partition once the ring stopped")

	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables))
	require.Equal(t, 10, b.outboxRows(t, "back.resumed"))
	require.Equal(t, 1, b.outboxRows(t, "back.after"))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE id = $1`, heldID))
	want := setup(t).layout(t)
	require.Equal(t, want, b.layout(t))
}

// What cannot be converted back is refused with what to do: a
// transaction, an outbox that does not exist; a single table is left
// alone.
func TestConvertToSingleRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := rotatingSetup(t)
	err := pgx.BeginFunc(ctx, b.Pool, func(txn pgx.Tx) error {
		return schema.ConvertToSingle(ctx, tx.FromPgxTx(txn), b.tables)
	})
	require.ErrorContains(t, err, "not a transaction")
	missing := b.tables
	missing.Table = "no_such_outbox"
	require.ErrorContains(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), missing), "does not exist")

	s := setup(t)
	before := s.layout(t)
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(s.Pool), s.tables))
	require.Equal(t, before, s.layout(t))
}

// A user index that holds the generation column would go with it: the
// conversion refuses before it changes anything.
func TestConvertToSingleRefusesAnIndexOnTheGeneration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := rotatingSetup(t)
	b.exec(t, `CREATE INDEX by_generation ON `+b.Schema+`.outbox (generation, topic)`)
	before := b.layout(t)
	err := schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables)
	require.ErrorContains(t, err, "by_generation")
	require.ErrorContains(t, err, "hold the generation column")
	require.Equal(t, before, b.layout(t), "nothing changed")
	require.Empty(t, b.strings(t, `SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
 WHERE d.adrelid = '`+b.Schema+`.outbox'::regclass AND a.attname = 'generation' AND pg_get_expr(d.adbin, d.adrelid) = '3'`), "the ring was not stopped")

	b.exec(t, `DROP INDEX `+b.Schema+`.by_generation`)
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables))
}

// Ids go on past every id the outbox and its dead letters ever had, both
// ways, even when nothing was published between the conversions (a
// restarted identity that was never used since) and after the rows were
// consumed: a dead letter keeps its id, and a requeue puts it back.
func TestConversionsNeverReuseAnID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	require.NoError(t, b.poolPublisher(t).Publish("ids.kept", newMsgs(5)...))
	last := b.count(t, `SELECT max(id)::int FROM `+b.Schema+`.outbox`)
	b.exec(t, `INSERT INTO `+b.Schema+`.outbox_dlq (id, topic, uuid, payload, metadata, created_at, deliveries, failure_reason)
  SELECT id, topic, uuid, payload, metadata, created_at, deliveries, 'failed' FROM `+b.Schema+`.outbox
   WHERE id = (SELECT min(id) FROM `+b.Schema+`.outbox)`)
	b.exec(t, `DELETE FROM `+b.Schema+`.outbox`)

	publishOne := func() int {
		t.Helper()
		require.NoError(t, b.poolPublisher(t).Publish("ids.new", newMsg("new")))
		id := b.count(t, `SELECT max(id)::int FROM `+b.Schema+`.outbox WHERE topic = 'ids.new'`)
		b.exec(t, `DELETE FROM `+b.Schema+`.outbox WHERE topic = 'ids.new'`)
		return id
	}
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables))
	id := publishOne()
	require.Greater(t, id, last, "there and back with nothing published between")

	rotating := b.tables
	rotating.Rotating = true
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))
	b.tables = rotating
	next := publishOne()
	require.Greater(t, next, id, "on the rotating outbox")
	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), rotating))
	b.tables.Rotating = false
	require.Greater(t, publishOne(), next, "back on the single table")
}

// The single table gets the grants of the rotating outbox, not those its
// long partition kept from the single table it was before: a grant
// revoked on the rotating outbox stays revoked.
func TestConvertToSingleKeepsOnlyTheRotatingOutboxsGrants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	role := "pgoutbox_revoked_" + b.Schema
	b.exec(t, `CREATE ROLE `+role)
	t.Cleanup(func() { b.exec(t, `DROP OWNED BY `+role); b.exec(t, `DROP ROLE `+role) })
	b.exec(t, `GRANT SELECT, DELETE ON `+b.Schema+`.outbox TO `+role)
	b.exec(t, `GRANT UPDATE (lease_token) ON `+b.Schema+`.outbox TO `+role)
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))
	b.exec(t, `REVOKE ALL ON `+b.Schema+`.outbox FROM `+role)
	b.exec(t, `REVOKE ALL (lease_token) ON `+b.Schema+`.outbox FROM `+role)
	b.exec(t, `GRANT INSERT ON `+b.Schema+`.outbox TO `+role)

	require.NoError(t, schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables))
	privileges := func(q string) []string {
		return b.strings(t, q, b.Schema+".outbox", role)
	}
	require.Equal(t, []string{"INSERT"}, privileges(`SELECT a.privilege_type::text FROM pg_class c, aclexplode(c.relacl) a
 WHERE c.oid = $1::regclass AND a.grantee = $2::regrole ORDER BY 1`))
	require.Empty(t, privileges(`SELECT att.attname::text FROM pg_attribute att, aclexplode(att.attacl) a
 WHERE att.attrelid = $1::regclass AND a.grantee = $2::regrole`))
}

// A rotation step of a process that still runs with the rotating setting
// may be under way when the swap comes: the swap waits for it rather
// than deadlocking with it (the step reads the generation sequence, then
// writes the outbox; the swap locks the outbox, then drops the sequence).
func TestConvertToSingleWaitsForARotationStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := rotatingSetup(t)
	require.NoError(t, b.poolPublisher(t).Publish("back.rotating", newMsgs(5)...))
	n, sq := b.singleConversion(t)
	rq := query.Build(n, false).RotationStatements
	// The indexes first, as an interrupted run left them: a build waits
	// for every older transaction, the step's too.
	for _, stmt := range append([]string{sq.StopRing}, sq.Prepared...) {
		b.exec(t, stmt)
	}

	// A rotation step, as Rotate runs it: its lock, then the current
	// generation (a read of the sequence, held to the end).
	step, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = step.Rollback(ctx) })
	var mine bool
	require.NoError(t, step.QueryRow(ctx, rq.RotationLock, n.QTable).Scan(&mine))
	require.True(t, mine)
	var cur int
	var age int64
	require.NoError(t, step.QueryRow(ctx, rq.Current).Scan(&cur, &age))

	done := make(chan error, 1)
	go func() { done <- schema.ConvertToSingle(ctx, tx.FromPgxPool(b.Pool), b.tables) }()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'advisory'
   AND pid IN (SELECT pid FROM pg_stat_activity WHERE datname = current_database())`) > 0
	}, 20*time.Second, 10*time.Millisecond, "the swap waits for the step")
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_locks WHERE mode = 'AccessExclusiveLock' AND relation = $1::regclass`, n.QTable),
		"and takes the outbox's lock only after it")
	// The step goes on to write the outbox, and ends.
	var moved int64
	require.NoError(t, step.QueryRow(ctx, rq.MoveLater[(cur+1)%3], 1.0, 10000).Scan(&moved))
	require.NoError(t, step.Commit(ctx))
	require.NoError(t, <-done)
	require.Equal(t, 5, b.outboxRows(t, "back.rotating"))
	require.Equal(t, setup(t).layout(t), b.layout(t))
}

// singleConversion returns the names of b's rotating outbox and the
// statements that convert it back, for tests that run a conversion's
// steps one by one.
func (b *bundle) singleConversion(t *testing.T) (query.Names, query.SingleConversionStatements) {
	t.Helper()
	single, err := query.NewNames(b.Schema, "outbox", "outbox_dlq")
	require.NoError(t, err)
	return single.Rotated(), query.SingleConversion(single.Rotated(), single)
}

// A publisher left with the other layout's setting after a conversion
// (scheduled, keyed and deduplicated publishes write what the layout's
// indexes must match) fails saying which setting to change, both ways.
func TestAPublisherOfTheOtherLayoutSaysToChangeRotating(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	exec := tx.FromPgxPool(b.Pool)
	scheduled := func() *message.Message {
		m := newMsg("later")
		pgoutbox.DeliverAfter(m, time.Hour)
		return m
	}
	require.NoError(t, schema.ConvertToRotating(ctx, exec, b.tables))
	single, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	err = single.Publish("t", scheduled())
	require.ErrorContains(t, err, "set Tables.Rotating")

	rotating := b.tables
	rotating.Rotating = true
	require.NoError(t, schema.ConvertToSingle(ctx, exec, rotating))
	stale, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: rotating}, nil)
	require.NoError(t, err)
	err = stale.Publish("t", scheduled())
	require.ErrorContains(t, err, "unset Tables.Rotating")
}
