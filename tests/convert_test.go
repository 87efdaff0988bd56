package tests

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Converting a single-table outbox that is in use, on each claim mode: a
// subscriber of the single table keeps a message in hand across the
// conversion and acks it after; the backlog, the timers and the dedup keys
// published before stay as they were; the roles granted the documented
// privileges on the single table publish and consume the rotating outbox,
// and its ring turns.
func TestConvertToRotatingKeepsAnOutboxInUse(t *testing.T) {
	onEachClaimMode(t, testConvertInUse)
}

func testConvertInUse(t *testing.T, mode pgoutbox.ClaimMode) {
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	pubPool := b.loginRole(t, "pub", publisherGrants...)
	subPool := b.loginRole(t, "sub", subscriberGrants...)

	// Before: a backlog, a timer an hour away with a dedup key, and a
	// subscriber of the single table holding one message.
	pub := b.poolPublisher(t)
	maxBefore := b.publishBeforeConversion(t, pub, "conv")
	held := b.holdOne(t, mode, "conv.backlog")

	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))

	isRot, err := schema.IsRotating(ctx, tx.FromPgxPool(b.Pool), b.tables)
	require.NoError(t, err)
	require.True(t, isRot)
	require.ErrorContains(t, schema.Validate(ctx, tx.FromPgxPool(b.Pool), b.tables), "is a rotating outbox; set Rotating")
	ring := *b
	ring.tables.Rotating = true
	require.NoError(t, schema.Validate(ctx, tx.FromPgxPool(b.Pool), ring.tables))
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), ring.tables), "converting again does nothing")

	// The subscriber that ran across the conversion acks what it held and
	// goes on with the backlog, from the long partition.
	held.ackAndTakeNine(t)
	require.Equal(t, 30, b.outboxRows(t, "conv.backlog"), "acks across the conversion removed their rows")
	require.Equal(t, "outbox_long", b.generationOf(t, "conv.backlog"))

	// A publisher that still runs with the single table's setting goes on
	// publishing unkeyed messages, into the ring; its keyed ones fail
	// (and a keyed row never reaches the ring, where its key would not be
	// unique).
	require.NoError(t, pub.Publish("conv.old", newMsg("old setting")))
	require.Equal(t, ring.generationName(t, 0), b.generationOf(t, "conv.old"))
	oldKeyed := newMsg("old setting, keyed")
	pgoutbox.WithDedupKey(oldKeyed, "daily-report")
	require.Error(t, pub.Publish("conv.timer", oldKeyed))
	_, err = b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, dedup_key) VALUES ('conv.timer', 'u', '', 'daily-report')`)
	require.ErrorContains(t, err, "outbox_g0_unkeyed", "the ring's partitions refuse keyed rows")

	// The publisher role publishes into the ring, the timer's key still
	// holds, and the ids go on from the single table's.
	rpub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: ring.tables}, b.logger)
	require.NoError(t, err)
	fresh := newMsgs(20)
	require.NoError(t, rpub.Publish("conv.fresh", fresh...))
	require.Equal(t, ring.generationName(t, 0), b.generationOf(t, "conv.fresh"))
	require.Greater(t, b.count(t, `SELECT min(id)::int FROM `+b.Schema+`.outbox WHERE topic = 'conv.fresh'`), maxBefore)
	again := newMsg("timer again")
	pgoutbox.WithDedupKey(again, "daily-report")
	res, err := rpub.PublishWithResult("conv.timer", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped(), "a dedup key published before the conversion still holds")
	require.Equal(t, 1, b.outboxRows(t, "conv.timer"))

	// The subscriber role consumes both and turns the ring.
	filesBefore := ring.filenodes(t)
	sub := ring.subscriberOn(t, subPool, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode = mode
		c.RotationWindow = 100 * time.Millisecond
	})
	subCtx, stop := context.WithCancel(ctx)
	defer stop()
	chans := map[string]<-chan *message.Message{}
	for topic, want := range map[string]int{"conv.backlog": 30, "conv.fresh": 20, "conv.old": 1} {
		ch, err := sub.Subscribe(subCtx, topic)
		require.NoError(t, err)
		ackAll(t, ch, want)
		chans[topic] = ch
	}
	require.Eventually(t, func() bool {
		return b.outboxRows(t, "conv.backlog")+b.outboxRows(t, "conv.fresh")+b.outboxRows(t, "conv.old") == 0
	}, 10*time.Second, 10*time.Millisecond)
	// These are consumed too: the ring truncates a partition only once
	// it is drained, and they go into whichever partition is current. If
	// the rotator's first step came after the backlog was consumed (a
	// loaded machine), that is still the first one, the partition the
	// ring must truncate; left unread, they would keep it from ever
	// draining.
	more := newMsgs(5)
	require.NoError(t, rpub.Publish("conv.fresh", more...))
	ackAll(t, chans["conv.fresh"], len(more))
	require.Eventually(t, func() bool { return ring.filenodes(t) != filesBefore }, 20*time.Second, 10*time.Millisecond,
		"the subscriber role rotates the converted outbox (a partition truncated)")
	require.Equal(t, 1, b.outboxRows(t, "conv.timer"), "the timer waits for its hour")
}

// The converted outbox is the one Create makes rotating: the same
// columns, indexes and partitions.
func TestConvertToRotatingMakesCreatesLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	single := setup(t)
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(single.Pool), single.tables))
	made := rotatingSetup(t)
	want := made.layout(t)
	require.Contains(t, want, "partition outbox_long FOR VALUES IN ('3') "+
		"autovacuum_vacuum_scale_factor=0.01,autovacuum_vacuum_insert_scale_factor=0.01,autovacuum_analyze_scale_factor=0.02 indexes 6")
	require.Equal(t, want, single.layout(t))
}

// layout describes the outbox's tables for comparison: columns with their
// types, nullability and defaults, index definitions, partitions with
// their bounds, storage parameters; the schema's name is left out.
func (b *bundle) layout(t *testing.T) []string {
	t.Helper()
	rows, err := b.Pool.Query(context.Background(), `
SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
       || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
 WHERE c.relnamespace = $1::regnamespace AND c.relname = 'outbox'
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
 WHERE c.relnamespace = $1::regnamespace AND c.relname = 'outbox'
UNION ALL
SELECT 'partition ' || c.relname || ' ' || pg_get_expr(c.relpartbound, c.oid) || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
       || ' indexes ' || (SELECT count(*) FROM pg_index i WHERE i.indrelid = c.oid)
  FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
 WHERE h.inhparent = ($1 || '.outbox')::regclass
UNION ALL
SELECT 'constraint ' || conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
 WHERE conrelid = ($1 || '.outbox')::regclass
    OR conrelid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = ($1 || '.outbox')::regclass)
UNION ALL
SELECT 'owner ' || relname || ' ' || relowner::regrole::text FROM pg_class
 WHERE relnamespace = $1::regnamespace
   AND relname IN ('outbox', 'outbox_g0', 'outbox_g1', 'outbox_g2', 'outbox_long', 'outbox_generation', 'outbox_id_seq')
ORDER BY 1`, b.Schema)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for i := range out {
		out[i] = strings.ReplaceAll(out[i], b.Schema+".", "SCHEMA.")
	}
	return out
}

// A conversion interrupted part way (a cancelled index build leaves an
// invalid index; the column and its check were added) goes on from where
// it stopped when run again, and the outbox ends as Create makes one,
// owned by the single table's owner, not by whoever converted it.
func TestConvertToRotatingGoesOnFromWhereItStopped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	owner := b.ownerRole(t)
	_, err := b.Pool.Exec(ctx, `ALTER TABLE `+b.Schema+`.outbox OWNER TO `+owner)
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("conv.resumed", newMsgs(10)...))
	n, err := query.NewNames(b.Schema, "outbox", "outbox_dlq")
	require.NoError(t, err)
	q := query.Conversion(n.Rotated())
	for _, stmt := range []string{q.Prepare, q.Prepared[0], q.Prepare} {
		_, err := b.Pool.Exec(ctx, stmt)
		require.NoError(t, err)
	}
	// What a cancelled CREATE INDEX CONCURRENTLY leaves.
	_, err = b.Pool.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass`, b.Schema+"."+q.PreparedNames[0])
	require.NoError(t, err)

	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))
	require.Equal(t, 10, b.outboxRows(t, "conv.resumed"))
	got := b.layout(t)
	require.Contains(t, got, "owner outbox "+owner)
	require.Contains(t, got, "owner outbox_g1 "+owner)
	require.Contains(t, got, "owner outbox_generation "+owner)
	made := rotatingSetup(t)
	want := made.layout(t)
	for i := range want {
		want[i] = strings.Replace(want[i], " postgres", " "+owner, 1)
	}
	require.Equal(t, want, got)
}

// An index the user gave storage parameters (a fillfactor) is one ATTACH
// adopts as it is, so the conversion takes it too, and it keeps them.
func TestConvertToRotatingKeepsAnIndexsStorageParameters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	n := b.names(t)
	_, err := b.Pool.Exec(ctx, `ALTER INDEX `+b.Schema+`.`+query.Quote(n.ReadyIdx)+` SET (fillfactor = 70)`)
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("conv.fillfactor", newMsgs(3)...))
	require.NoError(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables))
	require.Equal(t, 3, b.outboxRows(t, "conv.fillfactor"))
	var options []string
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT coalesce(c.reloptions, '{}') FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid = $1::regclass AND pg_get_indexdef(i.indexrelid) LIKE '%WHERE (lease_token IS NULL)%'`,
		b.Schema+".outbox_long").Scan(&options))
	require.Equal(t, []string{"fillfactor=70"}, options, "the long partition's ready index is the one the user tuned")
}

// ownerRole creates a role (no login) that is dropped, with what it owns,
// at the end of the test.
func (b *bundle) ownerRole(t *testing.T) string {
	t.Helper()
	role := "pgoutbox_owner_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	_, err := b.Pool.Exec(context.Background(), `CREATE ROLE `+role)
	require.NoError(t, err)
	t.Cleanup(func() {
		if _, err := b.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	return role
}

// What cannot be converted is refused with what to do, and nothing
// changes: an outbox with columns of the user's own, a conversion given a
// transaction, an outbox that does not exist.
func TestConvertToRotatingRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	_, err := b.Pool.Exec(ctx, `ALTER TABLE `+b.Schema+`.outbox ADD COLUMN tenant text`)
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("conv.refused", newMsg("kept")))
	err = schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), b.tables)
	require.ErrorContains(t, err, "columns pgoutbox does not know (tenant)")
	isRot, err := schema.IsRotating(ctx, tx.FromPgxPool(b.Pool), b.tables)
	require.NoError(t, err)
	require.False(t, isRot)
	require.Equal(t, 1, b.outboxRows(t, "conv.refused"))
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_attribute WHERE attrelid = '`+b.Schema+`.outbox'::regclass AND attname = 'generation'`),
		"refused before anything changed")

	err = pgx.BeginFunc(ctx, b.Pool, func(txn pgx.Tx) error {
		return schema.ConvertToRotating(ctx, tx.FromPgxTx(txn), b.tables)
	})
	require.ErrorContains(t, err, "not a transaction")

	missing := b.tables
	missing.Table = "no_such_outbox"
	require.ErrorContains(t, schema.ConvertToRotating(ctx, tx.FromPgxPool(b.Pool), missing), "does not exist; create a rotating outbox with schema.Create")
}

// The versioned migrations build a single table: asked for a rotating
// outbox's files, or to migrate a rotating outbox, they refuse and say
// what to use instead; a rotating outbox at the latest version has
// nothing to migrate.
func TestVersionedMigrationsRefuseARotatingOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := rotatingSetup(t)
	_, err := schema.Migrations(b.tables, schema.FormatGoose)
	require.ErrorIs(t, err, schema.ErrRotatingMigrations)
	require.ErrorContains(t, err, "schema.ConvertToRotating")
	steps, err := schema.Migrate(ctx, tx.FromPgxPool(b.Pool), b.tables, schema.Latest)
	require.NoError(t, err, "Create recorded the latest version")
	require.Empty(t, steps)

	single := b.tables
	single.Rotating = false
	_, err = schema.Migrate(ctx, tx.FromPgxPool(b.Pool), single, 3)
	require.ErrorIs(t, err, schema.ErrRotatingMigrations, "no single-table step on the partitioned table")
	_, err = schema.MigrationPlan(ctx, tx.FromPgxPool(b.Pool), single, 3)
	require.ErrorIs(t, err, schema.ErrRotatingMigrations, "a dry run refuses what the run would")
	plan, err := schema.MigrationPlan(ctx, tx.FromPgxPool(b.Pool), b.tables, schema.Latest)
	require.NoError(t, err)
	require.Empty(t, plan)
	require.NoError(t, schema.Validate(ctx, tx.FromPgxPool(b.Pool), b.tables), "nothing changed")
}

// publishBeforeConversion publishes what a conversion test carries across:
// 40 messages on <prefix>.backlog, and on <prefix>.timer one due in an
// hour with the dedup key "daily-report". It returns the largest id.
func (b *bundle) publishBeforeConversion(t *testing.T, pub *pgoutbox.Publisher, prefix string) int {
	t.Helper()
	require.NoError(t, pub.Publish(prefix+".backlog", newMsgs(40)...))
	timer := newMsg("timer")
	pgoutbox.WithDedupKey(timer, "daily-report")
	pgoutbox.DeliverAfter(timer, time.Hour)
	require.NoError(t, pub.Publish(prefix+".timer", timer))
	return b.count(t, `SELECT max(id)::int FROM `+b.Schema+`.outbox`)
}

// heldAcross is a subscriber holding one message of a topic, unacked,
// while the outbox is converted under it.
type heldAcross struct {
	sub    *pgoutbox.Subscriber
	ch     <-chan *message.Message
	stop   context.CancelFunc
	inHand *message.Message
}

// holdOne subscribes to topic with one message in flight (mode's claim
// path) and receives it.
func (b *bundle) holdOne(t *testing.T, mode pgoutbox.ClaimMode, topic string) *heldAcross {
	t.Helper()
	h := &heldAcross{sub: b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ClaimMode = mode; c.MaxInFlight = 1 })}
	ctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	h.stop = stop
	var err error
	h.ch, err = h.sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	h.inHand = receive(t, h.ch, 10*time.Second)
	return h
}

// ackAndTakeNine acks the message held across the conversion, handles
// nine more, and closes the subscriber, which writes its acks first.
func (h *heldAcross) ackAndTakeNine(t *testing.T) {
	t.Helper()
	h.inHand.Ack()
	select {
	case <-h.inHand.Acked():
	case <-time.After(10 * time.Second):
		t.Fatal("the message held across the conversion was not acked")
	}
	for range 9 {
		receive(t, h.ch, 10*time.Second).Ack()
	}
	h.stop()
	require.NoError(t, h.sub.Close())
}
