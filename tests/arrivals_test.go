package tests

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// onEachLayout runs f as parallel sub-tests "outbox" and "arrivals", on a
// bundle of a single-table outbox without and with arrivals.
func onEachLayout(t *testing.T, f func(t *testing.T, b *bundle)) {
	t.Helper()
	t.Run("outbox", func(t *testing.T) { t.Parallel(); f(t, setup(t)) })
	t.Run("arrivals", func(t *testing.T) { t.Parallel(); f(t, setupArrivals(t)) })
}

// setupArrivals is setup for an outbox with arrivals (schema.Config.Arrivals).
func setupArrivals(t *testing.T, opts ...pgoutboxtest.Options) *bundle {
	t.Helper()
	var o pgoutboxtest.Options
	if len(opts) > 0 {
		o = opts[0]
	}
	o.Arrivals = true
	env := pgoutboxtest.PubSubWithOptions(t, o)
	require.True(t, env.Tables.Arrivals)
	return &bundle{Env: env, tables: env.Tables, logger: watermill.NopLogger{}}
}

func (b *bundle) arrivals(t testing.TB, topic string) int {
	return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_arrivals WHERE topic = $1`, topic)
}

// waiting counts the messages of topic not yet acked: the outbox's rows
// and, with arrivals, the arrivals, in one statement: counted one after the
// other, an arrival a claim moved into the outbox between the two counts
// was in neither.
func (b *bundle) waiting(t testing.TB, topic string) int {
	if !b.tables.Arrivals {
		return b.outboxRows(t, topic)
	}
	return b.count(t, `SELECT (SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1) + (SELECT count(*) FROM `+b.Schema+`.outbox_arrivals WHERE topic = $1)`, topic)
}

// sortedUUIDs returns the UUIDs of the messages of every batch, sorted, as
// consumeGroup returns what it took.
func sortedUUIDs(batches ...[]*message.Message) []string {
	var out []string
	for _, ms := range batches {
		for _, m := range ms {
			out = append(out, m.UUID)
		}
	}
	slices.Sort(out)
	return out
}

// consumeGroup subscribes group to topic, takes n messages, acks them,
// checks that nothing more comes, and returns their UUIDs, sorted.
func (b *bundle) consumeGroup(t *testing.T, topic, group string, n int, mod func(*pgoutbox.SubscriberConfig)) []string {
	t.Helper()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		if mod != nil {
			mod(c)
		}
		c.ConsumerGroup, c.MaxInFlight = group, 8
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return takeUUIDs(t, ch, n)
}

// TestPubSubArrivals runs Watermill's universal suite on an outbox with
// arrivals, on each claim mode: every plain message the suite publishes
// arrives in the arrivals table and is taken from there (held where it
// is, leased by a move into the outbox), its consumer groups fanned out by
// the subscribers.
func TestPubSubArrivals(t *testing.T) {
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimHeld, pgoutbox.ClaimLease} {
		t.Run(mode.String(), func(t *testing.T) {
			b := setupArrivals(t, pgoutboxtest.Options{MaxConns: 30})
			tests.TestPubSub(t, universalFeatures(), universalConstructor(b, mode), universalGroupConstructor(b, mode))
		})
	}
}

// TestArrivalsTakePlainMessagesOnly: a plain message arrives in the
// arrivals table; a scheduled, keyed or deduplicated one, and what
// PublishWithResult writes, goes to the outbox as before.
func TestArrivalsTakePlainMessagesOnly(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	topic := "arrive-" + watermill.NewShortUUID()

	require.NoError(t, pub.Publish(topic, newMsg("one")))
	require.NoError(t, pub.Publish(topic, newMsgs(3)...))
	require.Equal(t, 4, b.arrivals(t, topic))
	require.Equal(t, 0, b.outboxRows(t, topic))

	scheduled := newMsg("later")
	pgoutbox.DeliverAfter(scheduled, time.Hour)
	keyed := newMsg("keyed")
	pgoutbox.WithOrderingKey(keyed, "k")
	dedup := newMsg("dedup")
	pgoutbox.WithDedupKey(dedup, "d")
	require.NoError(t, pub.Publish(topic, scheduled, keyed, dedup))
	_, err := pub.PublishWithResult(topic, newMsg("with result"))
	require.NoError(t, err)
	require.Equal(t, 4, b.arrivals(t, topic))
	require.Equal(t, 4, b.outboxRows(t, topic))

	// In the caller's transaction: the arrival exists iff it commits.
	for _, commit := range []bool{false, true} {
		tx0, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		p, err := pgoutbox.NewPublisher(tx.FromPgxTx(tx0), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		require.NoError(t, p.Publish(topic, newMsg(fmt.Sprint("tx ", commit))))
		if commit {
			require.NoError(t, tx0.Commit(ctx))
		} else {
			require.NoError(t, tx0.Rollback(ctx))
		}
	}
	require.Equal(t, 5, b.arrivals(t, topic), "the rolled-back publish left no arrival")

	// pgoutboxtest's assertions read both tables, in publish order.
	got := b.RequirePublished(t, tx.FromPgxPool(b.Pool), topic, pgoutboxtest.Count(9))
	require.Equal(t, "one", string(got[0].Payload))
	require.Equal(t, "tx true", string(got[8].Payload))
	b.RequireNotPublished(t, tx.FromPgxPool(b.Pool), topic, pgoutboxtest.WithPayload([]byte("tx false")))
}

// TestArrivalsOnEachClaimPath: arrivals are delivered, acked, retried
// after a nack (as a lease in the outbox, their delivery counted) and
// dead-lettered after a rejection, on every claim path; nothing is left.
func TestArrivalsOnEachClaimPath(t *testing.T) {
	b := setupArrivals(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		topic := "arrive-path-" + path + "-" + watermill.NewShortUUID()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c); c.MaxInFlight = 4 })
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)

		const n = 40
		msgs := newMsgs(n)
		msgs[7].Payload = []byte("nack")
		msgs[9].Payload = []byte("reject")
		require.NoError(t, b.poolPublisher(t).Publish(topic, msgs...))

		seen := map[string]int{}
		nacked := false
		for done := 0; done < n; {
			m := receive(t, ch, 10*time.Second)
			seen[m.UUID]++
			switch string(m.Payload) {
			case "nack":
				if !nacked {
					nacked = true
					m.Nack()
					continue
				}
				d, ok := pgoutbox.DeliveryOf(m)
				require.True(t, ok)
				require.Equal(t, 2, d.Attempt, "the retry of an arrival counts its first delivery")
			case "reject":
				_ = pgoutbox.Reject(m, "bad")
				m.Nack()
				done++
				continue
			}
			m.Ack()
			done++
		}
		require.Len(t, seen, n)
		require.Equal(t, 2, seen[msgs[7].UUID])
		require.Eventually(t, func() bool {
			return b.arrivals(t, topic) == 0 && b.outboxRows(t, topic) == 0
		}, 10*time.Second, 10*time.Millisecond, "every arrival acked or dead")
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE topic = $1 AND uuid = $2 AND failure_reason = 'rejected'`,
			topic, msgs[9].UUID))
	})
}

// TestArrivalsReachEveryBoundGroup: an arrival belongs to every group
// bound when it was published: each gets it once, whichever subscriber
// fans it out; the first groups of a topic get what arrived before them,
// and a group bound later only what arrives after.
func TestArrivalsReachEveryBoundGroup(t *testing.T) {
	b := setupArrivals(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		ctx := context.Background()
		topic := "arrive-groups-" + path + "-" + watermill.NewShortUUID()
		pub := b.poolPublisher(t)
		early := newMsgs(5)
		require.NoError(t, pub.Publish(topic, early...), "before any binding")
		_, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, []string{"a", "b"})
		require.NoError(t, err)
		middle := newMsgs(5)
		require.NoError(t, pub.Publish(topic, middle...))
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "c"))
		late := newMsgs(5)
		require.NoError(t, pub.Publish(topic, late...))

		want := map[string][]string{
			"a": sortedUUIDs(early, middle, late),
			"b": sortedUUIDs(early, middle, late),
			"c": sortedUUIDs(late),
		}
		for _, g := range []string{"a", "b", "c"} {
			got := b.consumeGroup(t, topic, g, len(want[g]), func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) })
			require.Equal(t, want[g], got, "group %s", g)
		}
		require.Zero(t, b.arrivals(t, topic))
	})
}

// Bind reports what its new groups got from before their binding the same
// way on both layouts: the messages published before a topic's first
// binding (Adopted), and the backlog of a group bound with
// StartFromBacklog (Copied). With arrivals both read 0 (the messages
// waited in the arrivals table, taken by the groups, not counted), and
// `pgoutbox bind` said the group got only what is published from then on.
func TestBindReportsWhatTheNewGroupsGetOnEachLayout(t *testing.T) {
	onEachLayout(t, func(t *testing.T, b *bundle) {
		ctx := context.Background()
		exec := tx.FromPgxPool(b.Pool)
		pub := b.poolPublisher(t)
		early := "report-early-" + watermill.NewShortUUID()
		require.NoError(t, pub.Publish(early, newMsgs(5)...), "before any binding")
		res, err := pgoutbox.BindGroups(ctx, exec, b.tables, early, []string{"x", "y"})
		require.NoError(t, err)
		require.Equal(t, int64(5), res.Adopted, "the first groups adopt what came before them")
		require.Zero(t, res.Copied)

		backlog := "report-backlog-" + watermill.NewShortUUID()
		require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, backlog, "a"))
		require.NoError(t, pub.Publish(backlog, newMsgs(10)...))
		res, err = pgoutbox.BindGroups(ctx, exec, b.tables, backlog, []string{"c"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
		require.NoError(t, err)
		require.Equal(t, int64(10), res.Copied, "a group from the backlog gets what waits")
		require.Zero(t, res.Adopted)
		res, err = pgoutbox.BindGroups(ctx, exec, b.tables, backlog, []string{"d"})
		require.NoError(t, err)
		require.Zero(t, res.Copied, "a group from now on gets nothing from before")
		require.Zero(t, res.Adopted)
		res, err = pgoutbox.BindGroups(ctx, exec, b.tables, backlog, []string{"c"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
		require.NoError(t, err)
		require.Zero(t, res.Copied, "binding a bound group again copies nothing")

		require.Len(t, b.consumeGroup(t, backlog, "c", 10, nil), 10, "and it gets them")
		require.Len(t, b.consumeGroup(t, early, "y", 5, nil), 5)
	})
}

// A group bound through a schema.Config without Arrivals (a deploy step,
// a relay or a service whose Tables lag behind the outbox) starts where a
// binding with it would: it gets what is published after it, none of the
// arrivals still waiting from before. Its binding once started at arrival
// 0, and the group got every one of them. Unbinding it the same way
// settles its arrivals: the others keep theirs, and nothing stays behind.
func TestArrivalsBindingWithoutTheSettingStartsFromNew(t *testing.T) {
	b := setupArrivals(t)
	ctx := context.Background()
	topic := "arrive-lagging-" + watermill.NewShortUUID()
	lagging := b.tables
	lagging.Arrivals = false
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "a"))
	pub := b.poolPublisher(t)
	before := newMsgs(5)
	require.NoError(t, pub.Publish(topic, before...))
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), lagging, topic, "c"))
	after := newMsgs(2)
	require.NoError(t, pub.Publish(topic, after...))
	require.Equal(t, sortedUUIDs(after), b.consumeGroup(t, topic, "c", len(after), nil), "group c")
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), lagging, topic, "d"))
	more := newMsgs(2)
	require.NoError(t, pub.Publish(topic, more...))
	_, err := pgoutbox.Unbind(ctx, tx.FromPgxPool(b.Pool), lagging, topic, "d", true)
	require.NoError(t, err)
	require.Equal(t, sortedUUIDs(before, after, more), b.consumeGroup(t, topic, "a", 9, nil), "group a")
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = 'd'`, topic), "nothing left for the unbound group")
	require.Equal(t, sortedUUIDs(more), b.consumeGroup(t, topic, "c", len(more), nil), "group c")
	require.Zero(t, b.arrivals(t, topic))
}

// Peek of the default group shows a topic's unbound messages on an outbox
// with arrivals too (arrivals no binding covers), which Stats counts and
// warns of: it showed none of them.
func TestArrivalsPeekShowsTheUnboundMessages(t *testing.T) {
	b := setupArrivals(t)
	ctx := context.Background()
	topic := "arrive-peek-" + watermill.NewShortUUID()
	msgs := newMsgs(3)
	require.NoError(t, b.poolPublisher(t).Publish(topic, msgs...))
	pending, err := pgoutbox.Peek(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "", 10)
	require.NoError(t, err)
	require.Len(t, pending, 3)
	for i, p := range pending {
		require.Equal(t, msgs[i].UUID, p.UUID)
	}
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "g"))
	pending, err = pgoutbox.Peek(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "", 10)
	require.NoError(t, err)
	require.Empty(t, pending, "adopted by the group bound")
	pending, err = pgoutbox.Peek(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "g", 10)
	require.NoError(t, err)
	require.Len(t, pending, 3)
}

// MoveGroup from the default group hands a topic's unbound messages to a
// group, as the consumer-groups guide says, on an outbox with arrivals
// too: there they are arrivals no binding covers, and it moved none of
// them, reporting 0 while Stats went on showing them unbound.
func TestArrivalsMoveGroupHandsOverTheUnboundMessages(t *testing.T) {
	b := setupArrivals(t)
	ctx := context.Background()
	topic := "arrive-move-" + watermill.NewShortUUID()
	msgs := newMsgs(3)
	require.NoError(t, b.poolPublisher(t).Publish(topic, msgs...))
	require.Equal(t, 3, b.arrivals(t, topic))
	moved, err := pgoutbox.MoveGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "", "g")
	require.NoError(t, err)
	require.EqualValues(t, 3, moved)
	require.Zero(t, b.arrivals(t, topic))
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "g"))
	require.Equal(t, sortedUUIDs(msgs), b.consumeGroup(t, topic, "g", 3, nil))
}

// First groups bound together with the default group among them get
// every message published before on an outbox with arrivals too: plain
// ones (arrivals) and keyed ones (outbox rows) alike.
func TestArrivalsFirstGroupsWithTheDefaultGroup(t *testing.T) {
	b := setupArrivals(t)
	ctx := context.Background()
	topic := "arrive-default-" + watermill.NewShortUUID()
	keyed := newMsg("keyed")
	pgoutbox.WithOrderingKey(keyed, "k")
	early := []*message.Message{newMsg("plain"), keyed}
	require.NoError(t, b.poolPublisher(t).Publish(topic, early...))
	_, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, []string{"", "a"})
	require.NoError(t, err)
	late := newMsg("late")
	require.NoError(t, b.poolPublisher(t).Publish(topic, late))
	want := []string{early[0].UUID, early[1].UUID, late.UUID}
	slices.Sort(want)
	for _, g := range []string{"", "a"} {
		require.Equal(t, want, b.consumeGroup(t, topic, g, len(want), nil), "group %q", g)
	}
}

// TestArrivalsInStats: Stats counts an arrival as a ready message of each
// group it belongs to, and one no group is bound for as unbound.
func TestArrivalsInStats(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	topic := "arrive-stats-" + watermill.NewShortUUID()
	pub := b.poolPublisher(t)
	require.NoError(t, pub.Publish(topic, newMsgs(3)...))

	stats, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic(topic))
	require.NoError(t, err)
	require.Len(t, stats, 1)
	require.Equal(t, "", stats[0].ConsumerGroup)
	require.False(t, stats[0].Bound)
	require.EqualValues(t, 3, stats[0].Unbound(), "nobody is bound yet")

	_, err = pgoutbox.BindGroups(ctx, exec, b.tables, topic, []string{"x", "y"})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, newMsg("4")))
	stats, err = pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic(topic))
	require.NoError(t, err)
	require.Len(t, stats, 2)
	for _, s := range stats {
		require.True(t, s.Bound)
		require.EqualValues(t, 4, s.Ready, "group %s: the first groups have what came before them", s.ConsumerGroup)
		require.Positive(t, s.OldestReadyAge)
	}
	without := b.tables
	without.Arrivals = false
	blind, err := pgoutbox.Stats(ctx, exec, without, pgoutbox.StatsForTopic(topic))
	require.NoError(t, err)
	require.Len(t, blind, len(stats))
	for i := range stats {
		stats[i].OldestReadyAge, blind[i].OldestReadyAge = 0, 0 // a later now()
	}
	require.Equal(t, stats, blind, "an operator's Stats counts the arrivals without being told of them")

	// Health reports the arrivals table beside the outbox.
	h, err := pgoutbox.Health(ctx, exec, without)
	require.NoError(t, err)
	require.NotNil(t, h.Arrivals)
	require.Equal(t, b.Schema+".outbox_arrivals", h.Arrivals.Table)
	require.Positive(t, h.Arrivals.TableBytes)

	// Peek shows them in delivery order, with the group's outbox rows.
	later := newMsg("due later")
	pgoutbox.DeliverAfter(later, time.Hour)
	require.NoError(t, pub.Publish(topic, later))
	for _, tables := range []schema.Config{b.tables, without} {
		pending, err := pgoutbox.Peek(ctx, exec, tables, topic, "x", 10)
		require.NoError(t, err)
		var payloads []string
		for _, p := range pending {
			payloads = append(payloads, string(p.Payload))
		}
		require.Equal(t, []string{"0", "1", "2", "4", "due later"}, payloads)
	}
}

// TestArrivalsOfAnUnboundGroupStayWithIt: Unbind of a group first gives
// it its arrivals as rows of its own, which stay for it (unbound) or are
// purged, as a group's rows are; the other group keeps its copies.
func TestArrivalsOfAnUnboundGroupStayWithIt(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	for _, purge := range []bool{false, true} {
		topic := fmt.Sprint("arrive-unbind-", purge, "-", watermill.NewShortUUID())
		_, err := pgoutbox.BindGroups(ctx, exec, b.tables, topic, []string{"keep", "go"})
		require.NoError(t, err)
		require.NoError(t, b.poolPublisher(t).Publish(topic, newMsgs(3)...))
		purged, err := pgoutbox.Unbind(ctx, exec, b.tables, topic, "go", purge)
		require.NoError(t, err)
		require.Zero(t, b.arrivals(t, topic), "fanned out to both groups")
		require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = 'keep'`, topic))
		left := b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = 'go'`, topic)
		if purge {
			require.EqualValues(t, 3, purged)
			require.Zero(t, left)
		} else {
			require.Equal(t, 3, left)
		}
	}
}

// TestArrivalsSchema: every single-table outbox has its arrivals table
// from version 7, so turning Arrivals on is a setting; an outbox of
// version 6 with rows gets it from Create or Migrate, and Validate with
// Arrivals reports it missing until then; Rotating refuses Arrivals; a
// conversion to a rotating outbox drops an empty arrivals table and
// refuses one that holds messages.
func TestArrivalsSchema(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)

	with := b.tables
	with.Arrivals = true
	require.NoError(t, schema.Validate(ctx, exec, with), "Create made the arrivals table without Arrivals")

	old := schema.Config{Schema: b.Schema, Table: "old"}
	_, err := schema.Migrate(ctx, exec, old, 6)
	require.NoError(t, err)
	oldPub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: old}, nil)
	require.NoError(t, err)
	require.NoError(t, oldPub.Publish("before", newMsg("kept")))
	oldWith := old
	oldWith.Arrivals = true
	var ve *schema.ValidationError
	require.ErrorAs(t, schema.Validate(ctx, exec, oldWith), &ve)
	require.Contains(t, fmt.Sprint(ve.Problems), "old_arrivals is missing")
	_, err = schema.Migrate(ctx, exec, oldWith, schema.Latest)
	require.NoError(t, err, "an outbox with Arrivals migrates like any other")
	require.NoError(t, schema.Validate(ctx, exec, oldWith))
	require.NoError(t, schema.Create(ctx, exec, oldWith), "idempotent")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.old WHERE topic = $1`, "before"))

	rotating := with
	rotating.Rotating = true
	require.ErrorContains(t, rotating.Validate(), "leave Arrivals unset")
	_, err = pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: rotating}, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)

	arrivedPub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: oldWith}, nil)
	require.NoError(t, err)
	require.NoError(t, arrivedPub.Publish("later", newMsg("arrived")))
	require.ErrorContains(t, schema.ConvertToRotating(ctx, exec, old), "holds messages",
		"its rotating subscribers would never take the arrivals")
	_, err = schema.Migrate(ctx, exec, old, 6)
	require.ErrorContains(t, err, "holds messages that version 6 has no place for")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.old_arrivals`), "nothing was lost")

	conv := schema.Config{Schema: b.Schema, Table: "conv", NoDeadLetterTable: true}
	require.NoError(t, schema.Create(ctx, exec, conv))
	require.NoError(t, schema.ConvertToRotating(ctx, exec, conv), "its arrivals table is empty")
	isRotating, err := schema.IsRotating(ctx, exec, conv)
	require.NoError(t, err)
	require.True(t, isRotating)
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = 'conv_arrivals'`, b.Schema),
		"a rotating outbox has no arrivals table")
	staleConv := conv
	staleConv.Arrivals = true
	stale, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: staleConv}, nil)
	require.NoError(t, err)
	require.ErrorContains(t, stale.Publish("later", newMsg("lost?")), "unset Tables.Arrivals",
		"a publisher left with Arrivals after the conversion is told what to do")
	// Version 7 of the versioned migrations, run on the outbox converted
	// from a migrated single table (a migration tool knows nothing of the
	// conversion), gives it no arrivals table.
	ms, err := schema.MigrationList(conv)
	require.NoError(t, err)
	for _, stmt := range ms[6].Up {
		_, err := b.Pool.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = 'conv_arrivals'`, b.Schema))
	require.NoError(t, schema.ConvertToSingle(ctx, exec, conv))
	conv.Arrivals = true
	require.NoError(t, schema.Validate(ctx, exec, conv), "the single table made from it has one again")
}

// TestArrivalsKeepPublishOrderAcrossASecondBinding: an ordered
// subscription (MaxInFlight 1) of a group that took its arrivals where
// they were keeps receiving them in publish order once a second group
// binds and the arrivals are fanned out to both.
func TestArrivalsKeepPublishOrderAcrossASecondBinding(t *testing.T) {
	b := setupArrivals(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		topic := "arrive-order-" + path + "-" + watermill.NewShortUUID()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c); c.ConsumerGroup = "first" })
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		pub := b.poolPublisher(t)
		const n = 120
		next := 0
		publish := func(k int) {
			for range k {
				require.NoError(t, pub.Publish(topic, newMsg(fmt.Sprint(next))))
				next++
			}
		}
		expect := 0
		take := func(k int) {
			for range k {
				m := receive(t, ch, 10*time.Second)
				require.Equal(t, fmt.Sprint(expect), string(m.Payload), "publish order")
				expect++
				m.Ack()
			}
		}
		publish(n / 2)
		take(n / 4) // some taken where they arrived
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "second"))
		publish(n / 2)
		take(n - n/4)
		requireNothing(t, ch, 100*time.Millisecond)
		require.Zero(t, b.arrivals(t, topic), "fanned out")
		require.Equal(t, n/2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = 'second'`, topic),
			"the second group has what was published after it bound")
	})
}

// TestArrivalsLeastPrivilege: the grants docs/arrivals.md adds to the
// least-privilege roles are enough: a publisher role publishes plain
// messages into the arrivals table (it takes their ids from the outbox's
// sequence); a subscriber role takes them on each claim path, binds a
// second group (which reads that sequence) and fans arrivals out.
func TestArrivalsLeastPrivilege(t *testing.T) {
	b := setupArrivals(t)
	arrivalsPublisherGrants := append(slices.Clip(publisherGrants),
		`GRANT INSERT ON %s.outbox_arrivals TO %r`,
		`GRANT USAGE ON SEQUENCE %s.outbox_id_seq TO %r`)
	arrivalsSubscriberGrants := append(slices.Clip(subscriberGrants),
		`GRANT SELECT, UPDATE, DELETE ON %s.outbox_arrivals TO %r`,
		`GRANT INSERT ON %s.outbox TO %r`,
		`GRANT USAGE ON SEQUENCE %s.outbox_id_seq TO %r`)
	pubPool := b.loginRole(t, "apub", arrivalsPublisherGrants...)
	subPool := b.loginRole(t, "asub", arrivalsSubscriberGrants...)
	for pool, stmt := range map[*pgxpool.Pool]string{
		pubPool: `SELECT payload FROM %s.outbox_arrivals`,
		subPool: `TRUNCATE %s.outbox_arrivals`,
	} {
		_, err := pool.Exec(context.Background(), fmt.Sprintf(stmt, b.Schema))
		require.ErrorContains(t, err, "permission denied", stmt)
	}
	onEachClaimPath(t, func(t *testing.T, path string) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		topic := "arrive-priv-" + path + "-" + watermill.NewShortUUID()
		pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		subscribe := func(group string) <-chan *message.Message {
			cfg := pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: group, MinPollInterval: 20 * time.Millisecond,
				MaxPollInterval: time.Second, DrainTimeout: time.Second, RetryPolicy: pgoutbox.NoRetry()}
			onPath(t, path, &cfg)
			sub, err := pgoutbox.NewSubscriber(subPool, cfg, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			return ch
		}
		first := subscribe("first")
		require.NoError(t, pub.Publish(topic, newMsg("alone")))
		m := receive(t, first, 10*time.Second)
		require.Equal(t, "alone", string(m.Payload))
		m.Nack() // NoRetry: dead-lettered, from the outbox (held: moved there first)
		second := subscribe("second")
		require.NoError(t, pub.Publish(topic, newMsg("both")))
		for _, ch := range []<-chan *message.Message{first, second} {
			m := receive(t, ch, 10*time.Second)
			require.Equal(t, "both", string(m.Payload))
			m.Ack()
		}
		require.Eventually(t, func() bool {
			return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE topic = $1`, topic) == 1 &&
				b.arrivals(t, topic)+b.outboxRows(t, topic) == 0
		}, 10*time.Second, 20*time.Millisecond)
	})
}

// TestArrivalsBesideOrderingKeys: on an outbox with arrivals, keyed
// messages (never arrivals) keep their per-key order on every claim path
// while plain ones arrive beside them and run in parallel.
func TestArrivalsBesideOrderingKeys(t *testing.T) {
	b := setupArrivals(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		topic := "arrive-keys-" + path + "-" + watermill.NewShortUUID()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c); c.MaxInFlight = 8 })
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		pub := b.poolPublisher(t)
		const perKey = 20
		// Held until every message is published: none is taken before.
		require.NoError(t, pgoutbox.PauseGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, ""))
		for i := range perKey {
			var keyed []*message.Message
			for _, k := range []string{"a", "b"} {
				m := newMsg(fmt.Sprint(k, i))
				pgoutbox.WithOrderingKey(m, k)
				keyed = append(keyed, m)
			}
			require.NoError(t, pub.Publish(topic, keyed...))                         // to the outbox
			require.NoError(t, pub.Publish(topic, newMsg("plain"), newMsg("plain"))) // arrivals
		}
		require.Equal(t, 2*perKey, b.arrivals(t, topic))
		_, err = pgoutbox.ResumeGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, "")
		require.NoError(t, err)
		next := map[string]int{"a": 0, "b": 0}
		plain := 0
		for range 4 * perKey {
			m := receive(t, ch, 10*time.Second)
			if p := string(m.Payload); p == "plain" {
				plain++
			} else {
				k := p[:1]
				require.Equal(t, fmt.Sprint(k, next[k]), p, "key %s out of order", k)
				next[k]++
			}
			m.Ack()
		}
		require.Equal(t, 2*perKey, plain)
		require.Equal(t, map[string]int{"a": perKey, "b": perKey}, next)
	})
}

// A subscriber whose Tables lack Arrivals, on a topic whose publishers put
// messages in the arrivals table, would claim the outbox alone and never
// see them, while all looked well: Subscribe refuses, saying what to set,
// and the messages wait for a subscriber that has it.
func TestArrivalsSubscriberWithoutTheSettingIsRefused(t *testing.T) {
	b := setupArrivals(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	topic := "arrive-unseen-" + watermill.NewShortUUID()
	msgs := newMsgs(3)
	require.NoError(t, b.poolPublisher(t).Publish(topic, msgs...))
	require.Equal(t, 3, b.arrivals(t, topic))

	lagging := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Tables.Arrivals = false })
	_, err := lagging.Subscribe(ctx, "arrive-other-"+watermill.NewShortUUID())
	require.NoError(t, err, "a topic without arrivals")
	_, err = lagging.Subscribe(ctx, topic)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "set Arrivals in the subscriber's schema.Config")

	require.Equal(t, sortedUUIDs(msgs), b.consumeGroup(t, topic, "", len(msgs), nil), "a subscriber with Arrivals gets them")
}

// An arrival's wake-up names its topic behind a mark of its own (chr(28)),
// which the notifier reads as "due now" and "arrived" (the dispatch test of
// internal/notifier): for one message and for a call of several.
func TestArrivalsWakeUpCarriesItsMark(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	listen := listenTo(t, b)
	for _, n := range []int{1, 3} {
		topic := "arrive-mark-" + watermill.NewShortUUID() // a topic of its own: no cooldown
		require.NoError(t, b.poolPublisher(t).Publish(topic, newMsgs(n)...))
		require.Equal(t, n, b.arrivals(t, topic))
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		got, err := listen.WaitForNotification(ctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, "\x1c"+topic, got.Payload)
	}
}

// A subscriber without Arrivals that runs when its topic's publishers turn
// Arrivals on (a deploy in the wrong order) never claims what arrives, and
// waited in silence while it piled up: it says so, and what to set, at
// the publishers' wake-up; a subscriber with Arrivals gets the messages.
func TestArrivalsASubscriberWithoutTheSettingSaysWhenTheyArrive(t *testing.T) {
	b := setupArrivals(t)
	logs := &logCapture{}
	b.logger = logs
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	topic := "arrive-later-" + watermill.NewShortUUID()
	lagging := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Tables.Arrivals = false })
	unseen, err := lagging.Subscribe(ctx, topic)
	require.NoError(t, err, "nothing waits in the arrivals table yet")
	said := func() bool {
		return len(logs.find("error", func(e logEntry) bool {
			return strings.Contains(e.msg, "arrivals table, which this subscriber does not read") &&
				strings.Contains(fmt.Sprint(e.fields["fix"]), "set Arrivals in the subscriber's schema.Config")
		})) > 0
	}
	// A message a round: the wake-up of one published before the
	// subscriber's LISTEN was up reaches nobody.
	var msgs []*message.Message
	for round := 0; !said(); round++ {
		require.Less(t, round, 20, "the subscriber without Arrivals never said that messages arrive where it does not look")
		m := newMsg("arrives")
		require.NoError(t, b.poolPublisher(t).Publish(topic, m))
		msgs = append(msgs, m)
		holdsWithin(said, 500*time.Millisecond)
	}
	require.Equal(t, len(msgs), b.arrivals(t, topic))
	require.NoError(t, lagging.Close())
	for m := range unseen { // closed by Close
		t.Fatalf("the subscriber without Arrivals got %s", m.UUID)
	}
	require.Equal(t, sortedUUIDs(msgs), b.consumeGroup(t, topic, "", len(msgs), nil), "a subscriber with Arrivals gets them")
}

// holdsWithin reports whether cond holds within d, polling it.
func holdsWithin(cond func() bool, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// A subscriber whose Tables set Arrivals, running when its outbox is
// converted to rotating (its publishers unset Arrivals first, as the
// docs say), claims nothing from then on: its claims name the arrivals
// table, gone. Its error said only that the relation does not exist; it
// says what to do.
func TestASubscriberLeftWithArrivalsAfterAConversionIsToldWhatToDo(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	logs := &lockedBuffer{}
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond},
		watermill.NewStdLoggerWithOut(logs, false, false))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	conv := b.tables
	conv.Arrivals = false
	require.NoError(t, schema.ConvertToRotating(context.Background(), tx.FromPgxPool(b.Pool), conv))
	pollUntil(t, "a claim's failure logged", 20*time.Second, nil, func() bool {
		return strings.Contains(logs.String(), "Claim failed")
	})
	require.Contains(t, logs.String(), "the outbox has no arrivals table")
	require.Contains(t, logs.String(), "unset it and restart the process")
}
