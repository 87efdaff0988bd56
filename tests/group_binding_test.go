package tests

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/cqrsbind"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
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

// A publish whose transaction saw a group's binding and commits after
// Unbind(purge) stores a copy for the group: Unbind waits for it and purges
// that copy too, so nothing is left that no bound group will consume.
func TestUnbindWithPurgeWaitsForAConcurrentPublishAndPurgesItsCopy(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"stays", "goes"})
	require.NoError(t, err)
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pgTx.Rollback(ctx) })
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", newMsg("in flight")))
	type result struct {
		purged int64
		err    error
	}
	unbound := make(chan result, 1)
	go func() {
		n, err := pgoutbox.Unbind(ctx, exec, b.tables, "t", "goes", true)
		unbound <- result{n, err}
	}()
	pollUntil(t, "the binding removed", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE topic = 't' AND consumer_group = 'goes'`) == 0
	})
	require.NoError(t, pgTx.Commit(ctx))
	r := <-unbound
	require.NoError(t, r.err)
	require.EqualValues(t, 1, r.purged, "the copy the open publish stored")
	require.Zero(t, b.groupRows(t, "t", "goes"))
	require.Equal(t, 1, b.groupRows(t, "t", "stays"))
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

type bookRoom struct {
	Room string `json:"room"`
}

type roomBooked struct {
	Room string `json:"room"`
}

// cqrsConfigs are the CQRS processor configurations of the tests: topic
// per command or event name, one pgoutbox subscriber per handler whose
// group is the handler name.
func (b *bundle) cqrsConfigs() (cqrs.CommandProcessorConfig, cqrs.EventProcessorConfig) {
	sub := func(handler string) (message.Subscriber, error) {
		return pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
			Tables: b.tables, ConsumerGroup: handler, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second,
		}, nil)
	}
	marshaler := cqrs.JSONMarshaler{}
	return cqrs.CommandProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
				return "commands." + p.CommandName, nil
			},
			SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return sub(p.HandlerName)
			},
			Marshaler: marshaler,
		}, cqrs.EventProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
				return "events." + p.EventName, nil
			},
			SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return sub(p.HandlerName)
			},
			Marshaler: marshaler,
		}
}

// Story 2: commands the API sends before the worker's first deploy are
// handled when the worker starts (its command handler's group is the
// first to bind the command topic).
func TestCQRSCommandsSentBeforeTheWorkersFirstDeployAreHandled(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	commandsCfg, _ := b.cqrsConfigs()
	bus, err := cqrs.NewCommandBusWithConfig(b.poolPublisher(t), cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) {
			return "commands." + p.CommandName, nil
		},
		Marshaler: commandsCfg.Marshaler,
	})
	require.NoError(t, err)
	for i := range 3 {
		require.NoError(t, bus.Send(ctx, &bookRoom{Room: fmt.Sprint(100 + i)}))
	}

	// The worker's first deploy.
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	commands, err := cqrs.NewCommandProcessorWithConfig(r, commandsCfg)
	require.NoError(t, err)
	handled := newHandledSet()
	require.NoError(t, commands.AddHandlers(cqrs.NewCommandHandler("book_room", func(ctx context.Context, c *bookRoom) error {
		handled.add(c.Room)
		return nil
	})))
	startRouter(t, r)
	pollUntil(t, "the three early commands handled", 20*time.Second, nil, func() bool { return handled.distinct() == 3 })
	pollUntil(t, "nothing left", 10*time.Second, nil, func() bool { return b.outboxRows(t, "commands.tests.bookRoom") == 0 })
}

// Watermill's CQRS examples share one subscriber between command
// handlers (each has its own topic). cqrsbind leaves it usable: it closed
// every subscriber SubscriberConstructor returned, and the Router then
// failed to start ("subscriber is closed").
func TestCQRSBindWithASharedCommandSubscriber(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	commandsCfg, _ := b.cqrsConfigs()
	shared, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
		Tables: b.tables, ConsumerGroup: "commands", MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = shared.Close() })
	commandsCfg.SubscriberConstructor = func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
		return shared, nil
	}
	handled := newHandledSet()
	handlers := []cqrs.CommandHandler{cqrs.NewCommandHandler("book_room", func(ctx context.Context, c *bookRoom) error {
		handled.add(c.Room)
		return nil
	})}
	require.NoError(t, cqrsbind.Commands(ctx, commandsCfg, handlers))
	bus, err := cqrs.NewCommandBusWithConfig(b.poolPublisher(t), cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) {
			return "commands." + p.CommandName, nil
		},
		Marshaler: commandsCfg.Marshaler,
	})
	require.NoError(t, err)
	require.NoError(t, bus.Send(ctx, &bookRoom{Room: "1"}))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	commands, err := cqrs.NewCommandProcessorWithConfig(r, commandsCfg)
	require.NoError(t, err)
	require.NoError(t, commands.AddHandlers(handlers...))
	startRouter(t, r)
	pollUntil(t, "the command handled", 20*time.Second, nil, func() bool { return handled.distinct() == 1 })

	// Two event handlers of one event sharing that subscriber would
	// compete for its events, each getting some: refused, saying why.
	_, eventsCfg := b.cqrsConfigs()
	eventsCfg.SubscriberConstructor = func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
		return shared, nil
	}
	twice := []cqrs.EventHandler{
		cqrs.NewEventHandler("invoice", func(context.Context, *roomBooked) error { return nil }),
		cqrs.NewEventHandler("mail", func(context.Context, *roomBooked) error { return nil }),
	}
	err = cqrsbind.Events(ctx, eventsCfg, twice)
	require.ErrorContains(t, err, `handlers "invoice" and "mail" subscribe topic`)
	require.ErrorContains(t, err, "its own group")

	// Handlers of different outboxes in groups of one name read different
	// tables: nothing competes (they were refused as if they did).
	other := schema.Config{Schema: b.Schema, Table: "other_outbox", DeadLetterTable: "other_dlq"}
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.Pool), other))
	perOutbox := map[string]schema.Config{"invoice": b.tables, "mail": other}
	eventsCfg.SubscriberConstructor = func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
		sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: perOutbox[p.HandlerName], ConsumerGroup: "audit"}, nil)
		if err == nil {
			t.Cleanup(func() { _ = sub.Close() })
		}
		return sub, err
	}
	require.NoError(t, cqrsbind.Events(ctx, eventsCfg, twice))
}

// eventBus publishes events to "events.<name>", as cqrsConfigs' event
// processor subscribes them.
func (b *bundle) eventBus(t *testing.T, eventsCfg cqrs.EventProcessorConfig) *cqrs.EventBus {
	t.Helper()
	bus, err := cqrs.NewEventBusWithConfig(b.poolPublisher(t), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "events." + p.EventName, nil },
		Marshaler:            eventsCfg.Marshaler,
	})
	require.NoError(t, err)
	return bus
}

// countingEventHandlers are roomBooked handlers of these names, each
// recording the rooms it saw.
func countingEventHandlers(names ...string) ([]cqrs.EventHandler, map[string]*handledSet) {
	counts := map[string]*handledSet{}
	var handlers []cqrs.EventHandler
	for _, name := range names {
		counts[name] = newHandledSet()
		handlers = append(handlers, cqrs.NewEventHandler(name, func(ctx context.Context, e *roomBooked) error {
			counts[name].add(e.Room)
			return nil
		}))
	}
	return handlers, counts
}

// cqrsbind binds every handler group of a processor ahead of traffic
// (a deploy step): events published before (unbound) and after it reach
// every handler, although no router ran yet.
func TestCQRSBindAheadOfTraffic(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	commandsCfg, eventsCfg := b.cqrsConfigs()
	bus := b.eventBus(t, eventsCfg)
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "early-1"}))
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "early-2"}))

	handlers, counts := countingEventHandlers("invoice", "notification", "statistics")
	commandHandlers := []cqrs.CommandHandler{cqrs.NewCommandHandler("book_room", func(ctx context.Context, c *bookRoom) error { return nil })}
	// The deploy step: no router, no subscription.
	require.NoError(t, cqrsbind.Events(ctx, eventsCfg, handlers))
	require.NoError(t, cqrsbind.Commands(ctx, commandsCfg, commandHandlers))
	require.Equal(t, 4, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings`), "three event groups and one command group")
	for i := range 3 {
		require.NoError(t, bus.Publish(ctx, &roomBooked{Room: fmt.Sprint("later-", i)}))
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	events, err := cqrs.NewEventProcessorWithConfig(r, eventsCfg)
	require.NoError(t, err)
	require.NoError(t, events.AddHandlers(handlers...))
	startRouter(t, r)
	for name, seen := range counts {
		pollUntil(t, name+" saw all five events", 20*time.Second, nil, func() bool { return seen.distinct() == 5 })
	}

	// A subscriber behind a decorator cannot be read: said so.
	bad := eventsCfg
	bad.SubscriberConstructor = func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
		return gochannel.NewGoChannel(gochannel.Config{}, nil), nil
	}
	require.ErrorContains(t, cqrsbind.Events(ctx, bad, handlers), "not a *pgoutbox.Subscriber")
}

// cqrsbind.EventGroups does the same for an EventGroupProcessor: two
// handler groups on one topic, bound ahead of traffic, each get the events
// published before and after the binding.
func TestCQRSBindEventGroupsAheadOfTraffic(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	_, eventsCfg := b.cqrsConfigs()
	bus, err := cqrs.NewEventBusWithConfig(b.poolPublisher(t), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "events", nil },
		Marshaler:            eventsCfg.Marshaler,
	})
	require.NoError(t, err)
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "early"}))

	groupsCfg := cqrs.EventGroupProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventGroupProcessorGenerateSubscribeTopicParams) (string, error) { return "events", nil },
		SubscriberConstructor: func(p cqrs.EventGroupProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
				Tables: b.tables, ConsumerGroup: p.EventGroupName, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second,
			}, nil)
		},
		Marshaler: eventsCfg.Marshaler,
	}
	counts := map[string]*handledSet{}
	groups := map[string][]cqrs.GroupEventHandler{}
	for _, name := range []string{"billing", "audit"} {
		counts[name] = newHandledSet()
		groups[name] = []cqrs.GroupEventHandler{cqrs.NewGroupEventHandler(func(ctx context.Context, e *roomBooked) error {
			counts[name].add(e.Room)
			return nil
		})}
	}
	require.NoError(t, cqrsbind.EventGroups(ctx, groupsCfg, groups))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings`), "one binding per handler group")
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "later"}))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	processor, err := cqrs.NewEventGroupProcessorWithConfig(r, groupsCfg)
	require.NoError(t, err)
	for name, handlers := range groups {
		require.NoError(t, processor.AddHandlersGroup(name, handlers...))
	}
	startRouter(t, r)
	for name, seen := range counts {
		pollUntil(t, name+" saw both events", 20*time.Second, nil, func() bool { return seen.distinct() == 2 })
	}
	require.ErrorContains(t, cqrsbind.EventGroups(ctx, cqrs.EventGroupProcessorConfig{}, groups), "needs GenerateSubscribeTopic and SubscriberConstructor")
}

// An EventProcessor's handlers and an EventGroupProcessor's group of the
// same events are the topic's first groups together when cqrsbind.Bind
// binds them in one call: each gets the event published before any
// binding. (Bound by cqrsbind.Events, then cqrsbind.EventGroups, the
// group bound second got none of it, silently: QA with 51 handlers.)
func TestCQRSBindBindsTheProcessorsOfOneTopicTogether(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	_, eventsCfg := b.cqrsConfigs()
	bus := b.eventBus(t, eventsCfg)
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "early"}))

	handlers, counts := countingEventHandlers("invoice", "statistics")
	counts["timeline"] = newHandledSet()
	groups := map[string][]cqrs.GroupEventHandler{"timeline": {cqrs.NewGroupEventHandler(func(ctx context.Context, e *roomBooked) error {
		counts["timeline"].add(e.Room)
		return nil
	})}}
	groupsCfg := cqrs.EventGroupProcessorConfig{
		GenerateSubscribeTopic: func(cqrs.EventGroupProcessorGenerateSubscribeTopicParams) (string, error) {
			return eventsCfg.GenerateSubscribeTopic(cqrs.EventProcessorGenerateSubscribeTopicParams{EventName: eventsCfg.Marshaler.Name(&roomBooked{})})
		},
		SubscriberConstructor: func(p cqrs.EventGroupProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
				Tables: b.tables, ConsumerGroup: p.EventGroupName, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second,
			}, nil)
		},
		Marshaler: eventsCfg.Marshaler,
	}
	require.ErrorContains(t, cqrsbind.Bind(ctx, cqrsbind.Processors{EventHandlers: handlers}), "EventHandlers without Events")
	require.NoError(t, cqrsbind.Bind(ctx, cqrsbind.Processors{Events: &eventsCfg, EventHandlers: handlers, EventGroups: &groupsCfg, Groups: groups}))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings`))
	require.NoError(t, bus.Publish(ctx, &roomBooked{Room: "later"}))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	events, err := cqrs.NewEventProcessorWithConfig(r, eventsCfg)
	require.NoError(t, err)
	require.NoError(t, events.AddHandlers(handlers...))
	processor, err := cqrs.NewEventGroupProcessorWithConfig(r, groupsCfg)
	require.NoError(t, err)
	require.NoError(t, processor.AddHandlersGroup("timeline", groups["timeline"]...))
	startRouter(t, r)
	for name, seen := range counts {
		pollUntil(t, name+" saw both events", 20*time.Second, nil, func() bool { return seen.distinct() == 2 })
	}
}

// A group bound with StartFromBacklog gets a copy of every message the
// topic holds, once, in batches: on a 200,000-row topic, cut short in the
// middle and resumed by the next Bind, while messages keep being
// published; afterwards it holds exactly the messages of the group that
// was there before. A group bound later without the option gets none.
// A message whose rows in the other groups lie far apart (one group's
// rows written long after the message: a copy of an earlier backlog
// binding, an adoption's copies) is copied once. The copy's batches see
// their own ids and the batch before: such a message was copied once per
// far row, every message twice.
func TestBindFromBacklogCopiesAMessageOnceWhateverItsRowsIds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	const n = 12000 // over two batches
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "far", "a"))
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload) SELECT 'far', 'a', 'u' || g, '\x00' FROM generate_series(1, 12000) g`)
	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "far", []string{"b"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.NoError(t, err)
	require.EqualValues(t, n, res.Copied)
	res, err = pgoutbox.BindGroups(ctx, exec, b.tables, "far", []string{"c"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.NoError(t, err)
	require.EqualValues(t, n, res.Copied, "each message once")
	require.Equal(t, n, b.groupRows(t, "far", "c"))
	require.Equal(t, n, b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE topic = 'far' AND consumer_group = 'c'`))
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE backlog_next IS NOT NULL OR backlog_end IS NOT NULL OR backlog_bound IS NOT NULL`), "the copies ended")
}

// The end of a backlog copy removes duplicate copies only: two messages
// published under one UUID while the copy ran (their own publish times)
// both stay in the new group, as in the others.
func TestBindFromBacklogKeepsMessagesPublishedUnderAUUIDInUse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('t', 'a')`)
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload) SELECT 't', 'a', 'u' || g, '\x00' FROM generate_series(1, 10) g`)
	// Group c's copy as it stands after its last batch, before its end.
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group, backlog_next, backlog_bound, backlog_end)
		SELECT 't', 'c', max(id), max(id), max(id) FROM %s.outbox`)
	pub := b.poolPublisher(t)
	require.NoError(t, pub.Publish("t", message.NewMessage("order-42", []byte("placed"))))
	require.NoError(t, pub.Publish("t", message.NewMessage("order-42", []byte("paid"))))
	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"c"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.NoError(t, err)
	require.GreaterOrEqual(t, res.Copied, int64(0))
	for _, g := range []string{"a", "c"} {
		require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = 't' AND consumer_group = $1 AND uuid = 'order-42'`, g), g)
	}
}

// The default group's rows while it is unbound, beside a bound group, are
// strays adoption cannot take (a dedup key the group holds): Unbind with
// purge deletes them, as the docs say. With no group bound they are the
// messages waiting for the topic's first group, and stay.
func TestUnbindPurgeOfTheUnboundDefaultGroup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload) VALUES ('w', '', 'u0', '\x00')`)
	n, err := pgoutbox.Unbind(ctx, exec, b.tables, "w", "", true)
	require.ErrorIs(t, err, pgoutbox.ErrNotBound)
	require.Zero(t, n)
	require.Equal(t, 1, b.groupRows(t, "w", ""), "the message waiting for the first group stays")

	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, dedup_key) VALUES ('k', '', 'u1', '\x00', 'key1')`)
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('k', 'a')`)
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, dedup_key) VALUES ('k', 'a', 'u3', '\x00', 'key1')`)
	_, err = pgoutbox.BindGroups(ctx, exec, b.tables, "k", []string{"a"})
	require.NoError(t, err)
	require.Equal(t, 1, b.groupRows(t, "k", ""), "adoption left the stray")
	n, err = pgoutbox.Unbind(ctx, exec, b.tables, "k", "", true)
	require.ErrorIs(t, err, pgoutbox.ErrNotBound)
	require.EqualValues(t, 1, n)
	require.Zero(t, b.groupRows(t, "k", ""))
}

// First groups of a fresh topic bound together get every message
// published before, also when the default group is among them: it keeps
// its rows, the others get a copy each (they got none: adoption never
// moves rows of a bound default group). Keyed, deduplicated and scheduled
// messages too.
func TestFirstGroupsWithTheDefaultGroupEachGetEveryMessage(t *testing.T) {
	t.Parallel()
	for name, bind := range map[string]func(b *bundle, topic string) error{
		"BindGroups": func(b *bundle, topic string) error {
			_, err := pgoutbox.BindGroups(context.Background(), tx.FromPgxPool(b.Pool), b.tables, topic, []string{"", "a"})
			return err
		},
		"BindGroups from the backlog": func(b *bundle, topic string) error {
			_, err := pgoutbox.BindGroups(context.Background(), tx.FromPgxPool(b.Pool), b.tables, topic, []string{"", "a"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
			return err
		},
		"BindSubscribers (cqrsbind)": func(b *bundle, topic string) error {
			return pgoutbox.BindSubscribers(context.Background(), topic, b.subscriber(t, nil), b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "a" }))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			keyed, dedup, later := newMsg("keyed"), newMsg("dedup"), newMsg("later")
			pgoutbox.WithOrderingKey(keyed, "k")
			pgoutbox.WithDedupKey(dedup, "d")
			pgoutbox.DeliverAfter(later, time.Hour)
			require.NoError(t, b.poolPublisher(t).Publish("first", newMsg("plain"), keyed, dedup, later))
			require.NoError(t, bind(b, "first"))
			for _, g := range []string{"", "a"} {
				require.Equal(t, 4, b.groupRows(t, "first", g), "group %q", g)
			}
			require.NoError(t, b.poolPublisher(t).Publish("first", newMsg("after")))
			for _, g := range []string{"", "a"} {
				require.Equal(t, 5, b.groupRows(t, "first", g), "group %q", g)
			}
		})
	}
}

// A Subscribe that binds a new group says so once, at INFO: a group name
// misspelt in a config is a new group, which gets nothing published
// before and a copy of everything after.
func TestSubscribeOfANewGroupSaysItBoundOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "invoices", "billing"))
	bound := func(logs *logCapture) int {
		return len(logs.find("info", func(e logEntry) bool {
			return strings.HasPrefix(e.msg, "Bound a new consumer group") && e.fields["consumer_group"] == "biling"
		}))
	}
	for i, want := range []int{1, 0} {
		logs := &logCapture{}
		sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: "biling"}, logs)
		require.NoError(t, err)
		sctx, cancel := context.WithCancel(ctx)
		_, err = sub.Subscribe(sctx, "invoices")
		require.NoError(t, err)
		cancel()
		require.NoError(t, sub.Close())
		require.Equal(t, want, bound(logs), "Subscribe %d", i+1)
	}
}

// BindSubscribers binds the handlers of a fresh topic as its first groups
// whatever their StartFrom, order and pool: each gets what was published
// before.
// On a bound topic, each gets what its StartFrom says.
func TestBindSubscribersOfMixedStartFrom(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	sub := func(group string, from pgoutbox.StartFrom) *pgoutbox.Subscriber {
		return b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup, c.StartFrom = group, from })
	}
	other, err := pgxpool.New(ctx, b.DSN) // a handler on a pool of its own
	require.NoError(t, err)
	t.Cleanup(other.Close)
	ledger, err := pgoutbox.NewSubscriber(other, pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: "ledger"}, b.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ledger.Close() })
	require.NoError(t, b.poolPublisher(t).Publish("fresh", newMsgs(5)...))
	require.NoError(t, pgoutbox.BindSubscribers(ctx, "fresh",
		sub("invoice", pgoutbox.StartFromBacklog), sub("mail", pgoutbox.StartFromNew), sub("stats", ""), ledger))
	for _, g := range []string{"invoice", "mail", "stats", "ledger"} {
		require.Equal(t, 5, b.groupRows(t, "fresh", g), "group %q of a fresh topic", g)
	}

	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "bound", "billing"))
	require.NoError(t, b.poolPublisher(t).Publish("bound", newMsgs(3)...))
	require.NoError(t, pgoutbox.BindSubscribers(ctx, "bound", sub("late", pgoutbox.StartFromBacklog), sub("new", pgoutbox.StartFromNew)))
	require.Equal(t, 3, b.groupRows(t, "bound", "late"), "StartFromBacklog on a bound topic: its backlog")
	require.Zero(t, b.groupRows(t, "bound", "new"), "StartFromNew on a bound topic: what comes next")
	require.NoError(t, b.poolPublisher(t).Publish("bound", newMsg("next")))
	for _, g := range []string{"billing", "late", "new"} {
		require.Equal(t, map[string]int{"billing": 4, "late": 4, "new": 1}[g], b.groupRows(t, "bound", g), "group %q", g)
	}
}

// A rename onto a name that is unbound but still holds the topic's rows
// (an Unbind without purge) is refused: the moved rows would sit beside
// its own copies of the same messages, each delivered twice.
func TestRenameOntoAnUnboundNameThatHoldsRowsIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "r", []string{"a", "x"})
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("r", newMsgs(3)...))
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "r", "x", false)
	require.NoError(t, err)
	_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "r", "a", "x")
	require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
	require.ErrorContains(t, err, "holds 3 of its messages")
	require.Equal(t, 3, b.groupRows(t, "r", "a"), "nothing moved")
	require.Equal(t, 3, b.groupRows(t, "r", "x"))
	st, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForGroup("r", "a"))
	require.NoError(t, err)
	require.True(t, st[0].Bound, "a is still bound under its name")
}

func TestBindFromBacklogOnALargeTopic(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 10})
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	const n = 200000
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "big", "a"))
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, available_at)
		SELECT 'big', 'a', 'u' || g, '\x00', now() - interval '1 minute' FROM generate_series(1, 200000) g`)

	stop := make(chan struct{})
	published := make(chan int)
	go func() {
		pub, total := b.poolPublisher(t), 0
		defer func() { published <- total }()
		pace := time.NewTicker(5 * time.Millisecond) // a steady trickle, not a load test
		defer pace.Stop()
		for {
			select {
			case <-stop:
				return
			case <-pace.C:
			}
			if err := pub.Publish("big", newMsgs(10)...); err != nil {
				t.Error(err)
				return
			}
			total += 10
		}
	}()

	cutCtx, cut := context.WithCancel(ctx)
	go func() {
		pollUntil(t, "the copy under way", 30*time.Second, nil, func() bool {
			return b.count(t, `SELECT coalesce(max(backlog_next), 0) FROM `+b.Schema+`.outbox_bindings WHERE consumer_group = 'b'`) > 0
		})
		cut()
	}()
	start := time.Now()
	_, err := pgoutbox.BindGroups(cutCtx, exec, b.tables, "big", []string{"b"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.ErrorIs(t, err, context.Canceled, "cut short")
	copiedBefore := b.groupRows(t, "big", "b")
	require.Less(t, copiedBefore, n)

	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "big", []string{"b"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
	require.NoError(t, err)
	took := time.Since(start)
	require.Empty(t, res.New, "bound already: the copy resumed")
	close(stop)
	total := <-published
	t.Logf("backlog copy of %d rows: %s (cut short after %d rows, resumed), %d messages published meanwhile", n, took.Round(time.Millisecond), copiedBefore, total)

	// Statistics for the checks below: a reused test schema may carry
	// some from another test's rows, and an anti-join planned on them as a
	// nested loop over 400,000 rows runs for minutes.
	b.exec(t, `ANALYZE %s.outbox`)
	require.Equal(t, n+total, b.groupRows(t, "big", "a"))
	require.Equal(t, n+total, b.groupRows(t, "big", "b"), "every message once")
	require.Equal(t, n+total, b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE consumer_group = 'b'`))
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox a WHERE a.consumer_group = 'a'
		AND NOT EXISTS (SELECT 1 FROM `+b.Schema+`.outbox c WHERE c.consumer_group = 'b' AND c.uuid = a.uuid)`))
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE backlog_next IS NOT NULL`), "done")

	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "big", "c"))
	require.Zero(t, b.groupRows(t, "big", "c"), "StartFromNew")
}

// Subscribe bounds each statement of its binding by StatementTimeout: a
// subscriber with a short one joining a topic with a large backlog
// (StartFromBacklog) copies it in smaller batches rather than failing
// Subscribe with a copy batch that outran the timeout.
func TestSubscribeWithAShortStatementTimeoutCopiesALargeBacklog(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const n = 50000
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "backlog", "a"))
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, available_at)
		SELECT 'backlog', 'a', 'u' || g, convert_to(repeat('x', 1000), 'UTF8'), now() - interval '1 minute' FROM generate_series(1, 50000) g`)
	// Statistics, so that a small batch is planned as one (without them a
	// copy of 50 rows took over 50 ms in a CI run); and a table of the
	// test's own, so that the schema is dropped rather than reused with
	// statistics that would mislead a later test's plans.
	b.exec(t, `CREATE TABLE %s.analyzed_here ()`)
	b.exec(t, `ANALYZE %s.outbox`)

	// 50 ms: the binding's own statements take a few milliseconds, a copy
	// of 5,000 rows of 200 bytes 60-70 (EXPLAIN ANALYZE of query.CopyBacklog),
	// of these 1,000-byte rows more, of 50 a few.
	sub := b.groupSubscriber(t, "late", func(c *pgoutbox.SubscriberConfig) {
		c.StartFrom = pgoutbox.StartFromBacklog
		c.StatementTimeout = 50 * time.Millisecond
	})
	// Connections made beforehand: under a loaded CI run a new one took
	// over 50 ms, and the binding failed for want of a connection, not
	// for its statements.
	var conns []*pgxpool.Conn
	for range 4 {
		c, err := b.Pool.Acquire(ctx)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	_, err := sub.Subscribe(subCtx, "backlog")
	require.NoError(t, err)
	require.Equal(t, n, b.groupRows(t, "backlog", "late"), "the whole backlog copied by the time Subscribe returns")
}

// A publish whose transaction stays open across a topic's first binding,
// longer than the binding waits for it (a long import during a new
// service's deploy), stores its message for no group. The subscriber adopts
// it once that transaction commits, on every claim path, instead of leaving
// it to the next Subscribe or Bind: whether its Subscribe made the binding,
// or BindSubscribers (cqrsbind's deploy step) did before it started.
func TestAPublishOpenLongerThanTheFirstBindingWaitsReachesTheGroup(t *testing.T) {
	t.Parallel()
	for _, by := range []string{"Subscribe", "BindSubscribers"} {
		t.Run(by, func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				b := setup(t)
				ctx := context.Background()
				shortWriterWait(t, b, 200*time.Millisecond)
				importTx, imported := openImport(t, b)

				audit := b.groupSubscriber(t, "audit", func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) })
				if by == "BindSubscribers" {
					require.NoError(t, pgoutbox.BindSubscribers(ctx, "imports", audit)) // its wait for the import ends
				}
				subCtx, cancel := context.WithCancel(ctx)
				defer cancel()
				msgs, err := audit.Subscribe(subCtx, "imports")
				require.NoError(t, err)
				require.NoError(t, importTx.Commit(ctx))
				got := receive(t, msgs, 15*time.Second)
				require.Equal(t, imported.UUID, got.UUID)
				got.Ack()
			})
		})
	}
}

// Bind cannot adopt what a publish open across the topic's first binding
// stores after its wait: its result names that publish, the message waits
// unbound, and the next Bind hands it to the group.
func TestBindNamesThePublishesStillOpenAcrossTheFirstBinding(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	shortWriterWait(t, b, time.Millisecond)
	importTx, imported := openImport(t, b)
	var vxid string
	require.NoError(t, importTx.QueryRow(ctx, `SELECT virtualtransaction FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'virtualxid'`).Scan(&vxid))

	exec := tx.FromPgxPool(b.Pool)
	res, err := pgoutbox.BindGroups(ctx, exec, b.tables, "imports", []string{"audit"})
	require.NoError(t, err)
	require.Equal(t, []string{"audit"}, res.New)
	require.Equal(t, []string{vxid}, res.StillPublishing)
	require.NoError(t, importTx.Commit(ctx))

	stats, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic("imports"))
	require.NoError(t, err)
	var unbound int64
	for _, s := range stats {
		unbound += s.Unbound()
	}
	require.EqualValues(t, 1, unbound, "the import's message waits for a binding: %+v", stats)

	res, err = pgoutbox.BindGroups(ctx, exec, b.tables, "imports", []string{"audit"})
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Adopted)
	require.Empty(t, res.StillPublishing)
	sub := b.groupSubscriber(t, "audit", nil)
	msgs, err := sub.Subscribe(ctx, "imports")
	require.NoError(t, err)
	got := receive(t, msgs, 15*time.Second)
	require.Equal(t, imported.UUID, got.UUID)
	got.Ack()
}

// A publish open across a StartFromBacklog binding for longer than the
// binding's wait for it stores its message for the groups it saw: the new
// group's backlog copy waits for it (Subscribe, BindSubscribers) or is left
// to the group's next binding (Bind), so that it sees that message. The
// publish writes one message before the binding, one in a savepoint, and
// one after the binding (which it sees: that message reaches the group
// once).
func TestAPublishOpenLongerThanABacklogBindingsWaitReachesTheNewGroup(t *testing.T) {
	t.Parallel()
	type run struct {
		b                        *bundle
		importTx                 pgx.Tx
		before, imported, inSave *message.Message
	}
	start := func(t *testing.T) run {
		b := setup(t)
		ctx := context.Background()
		// The wait for the writers ends at once: the import commits after
		// the binding, so after the wait, and the copy must wait on.
		shortWriterWait(t, b, time.Millisecond)
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "orders", "billing"))
		r := run{b: b, before: newMsg("before"), imported: newMsg("imported"), inSave: newMsg("in a savepoint")}
		require.NoError(t, b.poolPublisher(t).Publish("orders", r.before))
		var err error
		r.importTx, err = b.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.importTx.Rollback(ctx) })
		publishIn(t, b, r.importTx, "orders", r.imported) // for billing alone: audit is not bound yet
		save, err := r.importTx.Begin(ctx)                // a savepoint, released
		require.NoError(t, err)
		publishIn(t, b, save, "orders", r.inSave)
		require.NoError(t, save.Commit(ctx))
		return r
	}
	// bound waits for audit's binding, then publishes in the open import
	// (which now sees audit) and commits it.
	finish := func(t *testing.T, r run) *message.Message {
		pollUntil(t, "audit bound", 15*time.Second, nil, func() bool {
			return r.b.count(t, `SELECT count(*) FROM `+r.b.Schema+`.outbox_bindings WHERE topic = 'orders' AND consumer_group = 'audit'`) == 1
		})
		after := newMsg("after the binding")
		publishIn(t, r.b, r.importTx, "orders", after)
		require.NoError(t, r.importTx.Commit(context.Background()))
		return after
	}
	t.Run("Subscribe", func(t *testing.T) {
		t.Parallel()
		onEachClaimPath(t, func(t *testing.T, path string) {
			r := start(t)
			audit := r.b.groupSubscriber(t, "audit", func(c *pgoutbox.SubscriberConfig) {
				c.StartFrom = pgoutbox.StartFromBacklog
				onPath(t, path, c)
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			type subscribed struct {
				msgs <-chan *message.Message
				err  error
			}
			done := make(chan subscribed, 1)
			go func() {
				msgs, err := audit.Subscribe(ctx, "orders")
				done <- subscribed{msgs, err}
			}()
			after := finish(t, r)
			s := <-done
			require.NoError(t, s.err)
			var got []string
			for range 4 {
				m := receive(t, s.msgs, 15*time.Second)
				got = append(got, m.UUID)
				m.Ack()
			}
			require.ElementsMatch(t, []string{r.before.UUID, r.imported.UUID, r.inSave.UUID, after.UUID}, got)
			select {
			case m := <-s.msgs:
				t.Fatalf("a fifth message: %s", m.UUID)
			case <-time.After(300 * time.Millisecond):
			}
		})
	})
	t.Run("BindSubscribers", func(t *testing.T) {
		t.Parallel()
		r := start(t)
		audit := r.b.groupSubscriber(t, "audit", func(c *pgoutbox.SubscriberConfig) { c.StartFrom = pgoutbox.StartFromBacklog })
		bound := make(chan error, 1)
		go func() { bound <- pgoutbox.BindSubscribers(context.Background(), "orders", audit) }()
		after := finish(t, r)
		require.NoError(t, <-bound)
		require.ElementsMatch(t, []string{r.before.UUID, r.imported.UUID, r.inSave.UUID, after.UUID},
			column[string](t, r.b, `SELECT uuid FROM `+r.b.Schema+`.outbox WHERE topic = 'orders' AND consumer_group = 'audit'`))
	})
	t.Run("Bind", func(t *testing.T) {
		t.Parallel()
		r := start(t)
		ctx, exec := context.Background(), tx.FromPgxPool(r.b.Pool)
		backlog := pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog)
		// Bind does not wait past its wait: it says the copy is left to the
		// group's next binding, the group bound meanwhile.
		_, err := pgoutbox.BindGroups(ctx, exec, r.b.tables, "orders", []string{"audit"}, backlog)
		require.ErrorContains(t, err, "resumes at the next Bind or Subscribe of the group")
		after := finish(t, r)
		res, err := pgoutbox.BindGroups(ctx, exec, r.b.tables, "orders", []string{"audit"}, backlog)
		require.NoError(t, err)
		require.EqualValues(t, 3, res.Copied, "the backlog and the open publish's two messages before the binding")
		require.ElementsMatch(t, []string{r.before.UUID, r.imported.UUID, r.inSave.UUID, after.UUID},
			column[string](t, r.b, `SELECT uuid FROM `+r.b.Schema+`.outbox WHERE topic = 'orders' AND consumer_group = 'audit'`))
	})
}

// publishIn publishes m to topic in the transaction in.
// shortWriterWait makes a binding's wait for the transactions writing to
// b's outbox end after d, for the test.
func shortWriterWait(t *testing.T, b *bundle, d time.Duration) {
	t.Helper()
	qtable := pgx.Identifier{b.Schema, "outbox"}.Sanitize()
	testhook.SetBindWriterWait(qtable, d)
	t.Cleanup(func() { testhook.SetBindWriterWait(qtable, 0) })
}

// openImport begins a transaction that publishes one message to topic
// "imports" and stays open (rolled back when the test ends, unless it
// committed): a long import across a binding.
func openImport(t *testing.T, b *bundle) (pgx.Tx, *message.Message) {
	t.Helper()
	importTx, err := b.Pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = importTx.Rollback(context.Background()) })
	imported := newMsg("imported")
	publishIn(t, b, importTx, "imports", imported)
	return importTx, imported
}

func publishIn(t *testing.T, b *bundle, in pgx.Tx, topic string, m *message.Message) {
	t.Helper()
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(in), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, m))
}

// An outbox of the previous release: topic "orders" has the default group
// bound (the upgrade from the first release bound it) and "billing", each
// with its copies; "commands" got two messages before its worker bound,
// which that release left in "" for good; "fresh" has no binding. After
// schema.Create, with subscribers of both releases running (a rolling
// deploy), nothing is lost or duplicated: the stranded commands go to the
// worker, the default group keeps its copies, and messages a binder of the
// previous release left unbound go to the next binder of the new one.
func TestUpgradeOfAnOutboxWithRowsInTheDefaultAndNamedGroups(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.exec(t, `ALTER TABLE %s.outbox_bindings DROP COLUMN backlog_next, DROP COLUMN backlog_bound, DROP COLUMN backlog_end`)
	require.Error(t, schema.Validate(ctx, exec, b.tables), "the previous release's bindings table")
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('orders', ''), ('orders', 'billing'), ('commands', 'worker')`)
	b.exec(t, `INSERT INTO %s.outbox (topic, consumer_group, uuid, payload) VALUES
		('orders', '', 'o1', ''), ('orders', 'billing', 'o1', ''), ('orders', '', 'o2', ''), ('orders', 'billing', 'o2', ''),
		('commands', '', 'c1', ''), ('commands', '', 'c2', ''), ('commands', 'worker', 'c3', ''),
		('fresh', '', 'f1', ''), ('fresh', '', 'f2', '')`)

	require.NoError(t, schema.Create(ctx, exec, b.tables))
	require.NoError(t, schema.Validate(ctx, exec, b.tables))
	require.False(t, b.statsOf(t, "commands", "").Bound)
	require.EqualValues(t, 2, b.statsOf(t, "commands", "").Unbound(), "Stats shows what the previous release stranded")

	// A subscriber of the previous release binds as it did, adopting nothing.
	b.exec(t, `INSERT INTO %s.outbox_bindings (topic, consumer_group) VALUES ('fresh', 'audit') ON CONFLICT DO NOTHING`)
	require.EqualValues(t, 2, b.statsOf(t, "fresh", "").Unbound())

	worker, err := b.groupSubscriber(t, "worker", nil).Subscribe(ctx, "commands")
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"c1", "c2", "c3"}, takeUUIDs(t, worker, 3), "the stranded commands reach the worker")
	audit, err := b.groupSubscriber(t, "audit", nil).Subscribe(ctx, "fresh")
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"f1", "f2"}, takeUUIDs(t, audit, 2), "the new release's binder adopts")
	def, err := b.subscriber(t, nil).Subscribe(ctx, "orders")
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"o1", "o2"}, takeUUIDs(t, def, 2), "the default group keeps its copies")
	billing, err := b.groupSubscriber(t, "billing", nil).Subscribe(ctx, "orders")
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"o1", "o2"}, takeUUIDs(t, billing, 2))

	// Publishers of either release run the same statement: one copy per bound group.
	m := newMsg("after")
	b.publishInTx(t, "orders", true, m)
	require.Equal(t, m.UUID, receive(t, def, 10*time.Second).UUID)
	require.Equal(t, m.UUID, receive(t, billing, 10*time.Second).UUID)
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic IN ('commands', 'fresh')`))
}

// SubscriberConfig.StartFrom: a subscriber whose Subscribe creates its
// group's binding with StartFromBacklog gets what the topic's other group
// holds; StartFromNew (the default) does not. An invalid value is refused.
func TestSubscriberStartFrom(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", "old"))
	waiting := newMsgs(3)
	b.publishInTx(t, "t", true, waiting...)

	fresh, err := b.groupSubscriber(t, "fresh", nil).Subscribe(ctx, "t")
	require.NoError(t, err)
	catchUp, err := b.groupSubscriber(t, "catch-up", func(c *pgoutbox.SubscriberConfig) { c.StartFrom = pgoutbox.StartFromBacklog }).Subscribe(ctx, "t")
	require.NoError(t, err)
	for i := range waiting {
		got := receive(t, catchUp, 10*time.Second)
		require.Equal(t, waiting[i].UUID, got.UUID, "the backlog in order")
		got.Ack()
	}
	requireNothing(t, fresh, 200*time.Millisecond)
	_, err = pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables, StartFrom: "earliest"}, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, `StartFrom is "earliest"`)
	_, err = pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidGroup)
}

// Bind in the caller's transaction: the binding, the adoption and the
// backlog copy commit or roll back with it.
func TestBindInsideATransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.publishInTx(t, "t", true, newMsgs(2)...)
	for _, commit := range []bool{false, true} {
		pgTx, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		res, err := pgoutbox.BindGroups(ctx, tx.FromPgxTx(pgTx), b.tables, "t", []string{"g"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
		require.NoError(t, err)
		require.EqualValues(t, 2, res.Adopted)
		if !commit {
			require.NoError(t, pgTx.Rollback(ctx))
			require.EqualValues(t, 2, b.statsOf(t, "t", "").Unbound(), "rolled back: still unbound")
			continue
		}
		require.NoError(t, pgTx.Commit(ctx))
	}
	require.Equal(t, 2, b.groupRows(t, "t", "g"))
	require.True(t, b.statsOf(t, "t", "g").Bound)
}

// A group renamed while its topic has traffic and another group gets
// every message exactly once under one name or the other, on both
// layouts: the binding is renamed in place (binding the new name and
// unbinding the old doubled the messages published between the two, or
// lost them in the other order).
func TestRenamingAGroupUnderTrafficLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	for _, arrivals := range []bool{false, true} {
		t.Run(fmt.Sprintf("arrivals=%v", arrivals), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.tables.Arrivals = arrivals
			ctx := context.Background()
			exec := tx.FromPgxPool(b.Pool)
			_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"other", "old"})
			require.NoError(t, err)

			published, stopTraffic := b.traffic(t, "t", 4)
			count := func() int { return int(published.Load()) }
			pollUntil(t, "traffic before the rename", 10*time.Second, nil, func() bool { return count() >= 200 })

			require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.tables, "t", "old"))
			_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "t", "old", "new")
			require.NoError(t, err)
			require.True(t, b.statsOf(t, "t", "new").Paused, "the pause goes with the binding")
			resumed, err := pgoutbox.ResumeGroup(ctx, exec, b.tables, "t", "new")
			require.NoError(t, err)
			require.True(t, resumed)

			before := count()
			pollUntil(t, "traffic after the rename", 10*time.Second, nil, func() bool { return count() >= before+200 })
			stopTraffic()

			// A subscriber of each group settles the arrivals (fans them out).
			for _, g := range []string{"other", "new"} {
				_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{g})
				require.NoError(t, err)
			}
			total := count()
			perGroup := func(group string) (rows, distinct int) {
				require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE topic = 't' AND consumer_group = $1`, group).Scan(&rows, &distinct))
				return rows, distinct
			}
			arrived := 0
			if arrivals {
				require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FROM `+b.Schema+`.outbox_arrivals`).Scan(&arrived))
			}
			rows, distinct := perGroup("new")
			require.Equal(t, distinct, rows, "no message twice in the renamed group")
			require.Equal(t, total, rows+arrived, "every message reached the renamed group")
			rows, _ = perGroup("other")
			require.Equal(t, total, rows+arrived, "and the other group")
			rows, _ = perGroup("old")
			require.Zero(t, rows, "nothing left in the old name")

			_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "t", "old", "newer")
			require.ErrorIs(t, err, pgoutbox.ErrNotBound)
			_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "t", "new", "other")
			require.ErrorIs(t, err, pgoutbox.ErrGroupBound)
			require.ErrorContains(t, err, "MoveGroup")
			_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "t", "", "x")
			require.ErrorIs(t, err, pgoutbox.ErrInvalidGroup)
			require.True(t, b.statsOf(t, "t", "new").Bound, "a refused rename changes nothing")
		})
	}
}

// A subscriber of the old name still running keeps what it holds, and
// each message reaches the group once, under one name or the other. On the
// held path with arrivals, the batch's end took the renamed binding for a
// group bound since (StartFromBacklog's late copies) and gave the new name
// a copy of every arrival the old subscriber acked: handled twice.
func TestRenamingAGroupWhoseSubscriberHoldsAMessage(t *testing.T) {
	t.Parallel()
	for _, path := range []string{testhook.PathHeld, testhook.PathLease} {
		for _, layout := range []string{"outbox", "arrivals"} {
			for _, ack := range []bool{true, false} {
				t.Run(path+"/"+layout+map[bool]string{true: "/ack", false: "/nack"}[ack], func(t *testing.T) {
					t.Parallel()
					b := layoutBundle(t, layout)
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					exec := tx.FromPgxPool(b.Pool)
					topic := "rename-" + watermill.NewShortUUID()
					subOld := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
						onPath(t, path, c)
						c.ConsumerGroup = "old"
						id := c.WorkerID
						testhook.SetHeldBound(id, time.Minute)
						t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
					})
					chOld, err := subOld.Subscribe(ctx, topic)
					require.NoError(t, err)
					require.NoError(t, b.poolPublisher(t).Publish(topic, newMsg("x")))
					m := receive(t, chOld, 10*time.Second)

					// While the old name's subscriber holds x: a held batch
					// keeps an outbox row locked, and the rename says so;
					// a held arrival stays where it arrived, and a lease is
					// the delivery's, not a waiting row.
					_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, topic, "old", "new")
					if path == testhook.PathHeld && layout == "outbox" {
						require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
						require.ErrorContains(t, err, "1 waiting row(s) of the old name are locked")
					} else {
						require.NoError(t, err)
					}
					if ack {
						m.Ack()
					} else {
						m.Nack()
					}
					require.NoError(t, subOld.Close()) // ends a held batch, writes the ack or nack
					// What the docs say to do once the old name's
					// subscribers have stopped.
					_, err = pgoutbox.MoveGroup(ctx, exec, b.tables, topic, "old", "new")
					require.NoError(t, err)
					want := 0
					if !ack {
						want = 1
					}
					got := b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1 AND consumer_group = 'new'`, topic)
					require.Equal(t, want, got, "rows of x under the new name after the old name's subscriber %s it",
						map[bool]string{true: "acked", false: "nacked"}[ack])
				})
			}
		}
	}
}

// A topic's first binding of several groups hands every group what was
// published before it, each in its key's order. The groups after the first
// by name get copies, made before the binding is visible: made after it,
// they came after a newer message of their key that a publish seeing the
// binding stored meanwhile ([3 0 1 2] in the second group). Only a publish
// in flight across the binding ("2") comes after it, as a late commit does.
func TestFirstBindingOfSeveralGroupsKeepsEachKeysOrderInEveryGroup(t *testing.T) {
	t.Parallel()
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			b := layoutBundle(t, layout)
			ctx := context.Background()
			keyed := func(p string) *message.Message { return keyedMsg("k", p) }
			require.NoError(t, b.poolPublisher(t).Publish("t", keyed("0"), keyed("1")))
			pgTx, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = pgTx.Rollback(ctx) })
			inTx, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			require.NoError(t, err)
			require.NoError(t, inTx.Publish("t", keyed("2")))
			bound := make(chan error, 1)
			go func() {
				_, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, "t", []string{"ga", "gb"})
				bound <- err
			}()
			pollUntil(t, "the bindings committed", 10*time.Second, nil, func() bool {
				return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE topic = 't'`) == 2
			})
			require.NoError(t, b.poolPublisher(t).Publish("t", keyed("3")))
			require.NoError(t, pgTx.Commit(ctx))
			require.NoError(t, <-bound)
			order := func(group string) []string {
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					c.ConsumerGroup = group
					c.MaxInFlight = 1
				})
				msgs, err := sub.Subscribe(ctx, "t")
				require.NoError(t, err)
				var got []string
				for range 4 {
					m := receive(t, msgs, 10*time.Second)
					got = append(got, string(m.Payload))
					m.Ack()
				}
				return got
			}
			require.Equal(t, []string{"0", "1", "2", "3"}, order("ga"), "the first group keeps the rows' ids")
			require.Equal(t, []string{"0", "1", "3", "2"}, order("gb"), "the copies of what committed before the binding come first")
		})
	}
}

// A renamed group's dead letters take its new name: the runbook's requeue
// gives them back to the renamed group, not to the old, unbound name.
func TestARenamedGroupsDeadLettersGoBackToIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	topic := "rename-dlq-" + watermill.NewShortUUID()
	subOld := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "old" })
	chOld, err := subOld.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish(topic, newMsg("x")))
	m := receive(t, chOld, 10*time.Second)
	require.Error(t, pgoutbox.Reject(m, "bad"))
	m.Nack()
	pollUntil(t, "the message dead-lettered", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE topic = $1`, topic) == 1
	})
	require.NoError(t, subOld.Close())

	_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, topic, "old", "new")
	require.NoError(t, err)
	n, err := pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: topic})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	subNew := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "new" })
	chNew, err := subNew.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := receive(t, chNew, 10*time.Second)
	require.Equal(t, "x", string(got.Payload))
	got.Ack()
}

// Unbind and RenameGroup wait for the publishes that saw the binding; one
// still open after the wait may store a copy under the group's old name
// later. They say so instead of reporting success: the default group is
// bound again (its late copy would pass for an unbound message, and the
// next group to bind would get that message twice), a purge is to be run
// again, a renamed group's late rows to be moved.
func TestUnbindAndRenameSayWhenAPublishOutlastsTheirWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	qtable := pgx.Identifier{b.Schema, "outbox"}.Sanitize()
	testhook.SetBindWriterWait(qtable, 200*time.Millisecond)
	t.Cleanup(func() { testhook.SetBindWriterWait(qtable, 0) })
	openPublish := func(topic string) pgx.Tx {
		t.Helper()
		long, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = long.Rollback(context.Background()) })
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(long), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish(topic, newMsg("late")))
		return long
	}

	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "defaults", ""))
	long := openPublish("defaults")
	_, err := pgoutbox.Unbind(ctx, exec, b.tables, "defaults", "", true)
	require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
	require.ErrorContains(t, err, "still open")
	require.True(t, b.statsOf(t, "defaults", "").Bound, "the default group is bound again")
	require.NoError(t, long.Rollback(ctx))

	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "purged", "billing"))
	require.NoError(t, b.poolPublisher(t).Publish("purged", newMsg("waiting")))
	long = openPublish("purged")
	purged, err := pgoutbox.Unbind(ctx, exec, b.tables, "purged", "billing", true)
	require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
	require.EqualValues(t, 1, purged, "what was purged, with the error")
	require.ErrorContains(t, err, "purge again once they have ended")
	require.False(t, b.statsOf(t, "purged", "billing").Bound, "unbound all the same")
	require.NoError(t, long.Commit(ctx))
	require.EqualValues(t, 1, b.statsOf(t, "purged", "billing").Unbound(), "the late copy the error warned of")

	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "renamed", "old"))
	long = openPublish("renamed")
	_, err = pgoutbox.RenameGroup(ctx, exec, b.tables, "renamed", "old", "new")
	require.ErrorIs(t, err, pgoutbox.ErrGroupNotEmpty)
	require.ErrorContains(t, err, "arrive under the old name")
	require.True(t, b.statsOf(t, "renamed", "new").Bound, "renamed all the same")
	require.NoError(t, long.Commit(ctx))
	moved, err := pgoutbox.MoveGroup(ctx, exec, b.tables, "renamed", "old", "new")
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "what the error said to move")
}

// A role's or database's lock_timeout (a defensive 50 ms here) cut short
// the wait of a Subscribe for the topic's binding lock while another
// bound it (a Router's handlers start together), and the Subscribe
// failed. The wait ignores it now; the rest of the transaction keeps it.
func TestSubscribeWaitsForTheBindingLockPastALockTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := b.poolWith(t, map[string]string{"lock_timeout": "50ms"}, nil)
	const topic = "lock-timeout-bind"
	holder, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	_, err = holder.Exec(ctx, query.TopicLock, b.names(t).QBindings+query.GroupMark+topic)
	require.NoError(t, err)
	var pid int
	require.NoError(t, holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	done := make(chan error, 1)
	go func() {
		_, err := sub.Subscribe(ctx, topic)
		done <- err
	}()
	pollUntil(t, "the Subscribe waits for the lock past the lock_timeout", 10*time.Second, nil, func() bool {
		select {
		case err := <-done:
			t.Fatalf("Subscribe returned while the lock was held: %v", err)
		default:
		}
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)) AND now() - query_start > interval '200 milliseconds'`, pid) > 0
	})
	require.NoError(t, holder.Commit(ctx))
	require.NoError(t, <-done)

	// The rest of the binding's transaction keeps the setting.
	later, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = later.Rollback(context.Background()) }()
	_, err = later.Exec(ctx, query.TopicLock, b.names(t).QBindings+query.GroupMark+topic)
	require.NoError(t, err)
	var lockTimeout string
	require.NoError(t, later.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lockTimeout))
	require.Equal(t, "50ms", lockTimeout)
}
