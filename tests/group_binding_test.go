package tests

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// groupRows counts the rows of one topic and group.
func (b *bundle) groupRows(t *testing.T, topic, group string) int {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = $2`, topic, group)
}

// statsOf returns the stats of one topic and group.
func (b *bundle) statsOf(t *testing.T, topic, group string) pgoutbox.QueueStats {
	t.Helper()
	st, err := pgoutbox.Stats(context.Background(), tx.FromPgxPool(b.Pool), b.tables, pgoutbox.StatsForGroup(topic, group))
	require.NoError(t, err)
	require.Len(t, st, 1)
	return st[0]
}

// Story 3: messages published while a topic has no binding are unbound
// (Stats says so), and the first group to bind gets them; the default
// group, bound later, starts at new messages like any later group.
func TestTheFirstGroupToBindGetsWhatWasPublishedBefore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	early := newMsgs(3)
	b.publishInTx(t, "t", true, early...)
	st := b.statsOf(t, "t", "")
	require.False(t, st.Bound)
	require.EqualValues(t, 3, st.Unbound(), "Stats shows the unbound messages")

	late, err := b.groupSubscriber(t, "late", nil).Subscribe(ctx, "t")
	require.NoError(t, err)
	for i := range early {
		got := receive(t, late, 10*time.Second)
		require.Equal(t, early[i].UUID, got.UUID, "in publish order")
		got.Ack()
	}
	require.Zero(t, b.statsOf(t, "t", "").Unbound())

	def, err := b.subscriber(t, nil).Subscribe(ctx, "t")
	require.NoError(t, err)
	later := newMsg("later")
	b.publishInTx(t, "t", true, later)
	got := receive(t, def, 10*time.Second)
	require.Equal(t, later.UUID, got.UUID, "the default group bound later starts at new messages")
	got.Ack()
	require.Equal(t, later.UUID, receive(t, late, 10*time.Second).UUID)
}

// If the default group is the first to bind, the unbound messages stay
// where they are, its own.
func TestTheDefaultGroupBindingFirstKeepsTheUnboundMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.publishInTx(t, "t", true, newMsgs(2)...)
	res, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", []string{""})
	require.NoError(t, err)
	require.Equal(t, []string{""}, res.New)
	require.Zero(t, res.Adopted)
	st := b.statsOf(t, "t", "")
	require.True(t, st.Bound)
	require.EqualValues(t, 2, st.Ready)
	require.Zero(t, st.Unbound())
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", "other"))
	require.Zero(t, b.groupRows(t, "t", "other"), "a later group starts at new messages")
}

// Groups bound together are all first groups: each gets every unbound
// message once. Binding concurrently, nothing is lost or duplicated
// (whoever adopts first gives every group bound by then its copy).
func TestFirstGroupsBoundTogetherEachGetTheUnboundMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.publishInTx(t, "t", true, newMsgs(12000)...) // more than one adoption batch
	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"invoice", "mail", "stats"})
	require.NoError(t, err)
	require.EqualValues(t, 12000, res.Adopted)
	for _, g := range []string{"invoice", "mail", "stats"} {
		require.Equal(t, 12000, b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE consumer_group = $1`, g))
		require.Equal(t, 12000, b.groupRows(t, "t", g), g)
	}
	require.Zero(t, b.groupRows(t, "t", ""))

	// Concurrent first binders of another topic.
	b.publishInTx(t, "u", true, newMsgs(500)...)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = pgoutbox.Bind(ctx, exec, b.tables, "u", fmt.Sprint("g", i)) })
	}
	wg.Wait()
	total := 0
	for i, err := range errs {
		require.NoError(t, err)
		n := b.groupRows(t, "u", fmt.Sprint("g", i))
		require.Contains(t, []int{0, 500}, n, "a group gets all of them or none")
		require.Equal(t, n, b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE topic = 'u' AND consumer_group = $1`, fmt.Sprint("g", i)))
		total += n
	}
	require.GreaterOrEqual(t, total, 500, "nothing lost")
	require.Zero(t, b.groupRows(t, "u", ""))
}

// A publish whose transaction began before the first binding and commits
// after it stores its message for "" (it could not see the binding): Bind
// waits for it and adopts it too.
func TestBindAdoptsWhatAConcurrentPublishStoredForNobody(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pgTx.Rollback(ctx) })
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	inFlight := newMsg("in flight")
	require.NoError(t, pub.Publish("t", inFlight))
	bound := make(chan error, 1)
	go func() { bound <- pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", "worker") }()
	pollUntil(t, "the binding committed", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE topic = 't'`) == 1
	})
	select {
	case err := <-bound:
		t.Fatalf("Bind returned (%v) while a publish it could not see was open", err)
	case <-time.After(100 * time.Millisecond):
	}
	require.NoError(t, pgTx.Commit(ctx))
	require.NoError(t, <-bound)
	require.Equal(t, 1, b.groupRows(t, "t", "worker"))
	require.Zero(t, b.groupRows(t, "t", ""))
}

// Story 1: a relay added to an outbox in use relays what its topics held
// before its first start, whatever its group: unbound messages (nothing
// consumed the topic), and the backlog of a group already bound. Lag
// counts them before the relay runs.
func TestARelayAddedLaterRelaysTheBacklog(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	targetTables, target := b.relayTarget(t)
	before := newMsgs(5)
	b.publishInTx(t, "orders", true, before...)
	// "audit" has a consumer already: its messages wait in the default group.
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "audit", ""))
	audits := newMsgs(4)
	b.publishInTx(t, "audit", true, audits...)

	cfg := relay.Config{Topics: []string{"orders", "audit"}, Subscriber: pgoutbox.SubscriberConfig{
		Tables: b.tables, ConsumerGroup: "relay", MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
	}}
	r, err := relay.New(b.Pool, target, cfg)
	require.NoError(t, err)
	lag, err := r.Lag(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, lag[0].Ready, "the unbound messages the relay will adopt")
	require.EqualValues(t, 4, lag[1].Ready, "the backlog the relay will copy")
	require.NoError(t, r.Close())

	b.startRelay(t, target, func(c *relay.Config) {
		c.Topics = []string{"orders", "audit"}
		c.Subscriber.ConsumerGroup = "relay"
	})
	relayed := `SELECT count(*) FROM ` + b.Schema + `.` + targetTables.Table + ` WHERE uuid = ANY ($1)`
	uuids := func(msgs []*message.Message) []string {
		var out []string
		for _, m := range msgs {
			out = append(out, m.UUID)
		}
		return out
	}
	pollUntil(t, "every earlier message relayed", 20*time.Second, nil, func() bool {
		return b.count(t, relayed, uuids(before)) == 5 && b.count(t, relayed, uuids(audits)) == 4
	})
	require.Equal(t, 4, b.groupRows(t, "audit", ""), "the default group keeps its own copies")
	require.Zero(t, b.groupRows(t, "orders", ""))
}

// Unbind of the default group refuses to turn its waiting messages into
// unbound ones; MoveGroup hands a group's waiting messages to another.
func TestUnbindDefaultGroupAndMoveGroup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"", "a"})
	require.NoError(t, err)
	b.publishInTx(t, "t", true, newMsgs(3)...)
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "t", "", false)
	require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
	require.True(t, b.statsOf(t, "t", "").Bound, "still bound")

	moved, err := pgoutbox.MoveGroup(ctx, exec, b.tables, "t", "", "b")
	require.NoError(t, err)
	require.EqualValues(t, 3, moved)
	st := b.statsOf(t, "t", "b")
	require.False(t, st.Bound)
	require.EqualValues(t, 3, st.Unbound(), "b is not bound: Stats shows its rows as stranded")
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "t", "", false)
	require.NoError(t, err, "empty now")
	_, err = pgoutbox.MoveGroup(ctx, exec, b.tables, "t", "b", "b")
	require.ErrorIs(t, err, pgoutbox.ErrInvalidGroup)
}
