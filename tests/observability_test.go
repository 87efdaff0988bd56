package tests

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// DeliveryOf tells a handler, on both claim paths and with one or several
// messages in flight, the message's attempt, publish time (its
// transaction's now()), due time, group, ordering key and claim path:
// first at the first delivery, then after a nack (attempt 2, due at the
// end of the retry delay, same publish time), then after a rejection and a
// requeue from the dead-letter table (attempt 1 again, same row and publish
// time, due at the requeue). Every hand-out is an EventHandedOut with the
// same facts.
func TestDeliveryFactsThroughRetryAndRequeue(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		mode     pgoutbox.ClaimMode
		path     string
		inFlight int
	}{
		{"Held/ordered", pgoutbox.ClaimHeld, pgoutbox.PathHeld, 1},
		{"Held/parallel", pgoutbox.ClaimHeld, pgoutbox.PathHeld, 4},
		{"Lease/ordered", pgoutbox.ClaimLease, pgoutbox.PathLease, 1},
		{"Lease/parallel", pgoutbox.ClaimLease, pgoutbox.PathLease, 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t)
			pool, _ := heldPool(t, b, 10)
			ev := newEvents()
			sub := b.subscriberOn(t, pool, func(cfg *pgoutbox.SubscriberConfig) {
				cfg.ClaimMode, cfg.MaxInFlight, cfg.ConsumerGroup, cfg.Observer = c.mode, c.inFlight, "billing", ev
				onPath(t, c.path, cfg) // every claim on the path, the reclaiming ones too
			})
			msgs, err := sub.Subscribe(ctx, "facts")
			require.NoError(t, err)
			// Publish in a transaction whose now() is known; the message is
			// keyed, so the key's facts are checked on both paths.
			const key = "order-7"
			pgTx, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			var published time.Time
			require.NoError(t, pgTx.QueryRow(ctx, `SELECT now()`).Scan(&published))
			pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			require.NoError(t, err)
			m := newMsg("x")
			pgoutbox.WithOrderingKey(m, key)
			require.NoError(t, pub.Publish("facts", m))
			var rowID int64
			require.NoError(t, pgTx.QueryRow(ctx, `SELECT id FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID).Scan(&rowID))
			require.NoError(t, pgTx.Commit(ctx))

			first := receive(t, msgs, 10*time.Second)
			d, ok := pgoutbox.DeliveryOf(first)
			require.True(t, ok)
			require.Equal(t, c.path, d.Path)
			require.Equal(t, "facts", d.Topic)
			require.Equal(t, "billing", d.ConsumerGroup)
			require.Equal(t, rowID, d.RowID)
			require.Equal(t, 1, d.Attempt)
			require.True(t, d.PublishedAt.Equal(published), "published %s, want the transaction's now() %s", d.PublishedAt, published)
			require.True(t, d.DueAt.Equal(published), "due %s: an undelayed message is due when published", d.DueAt)
			require.Equal(t, key, d.OrderingKey)

			nackedAt := time.Now()
			first.Nack()
			second := receive(t, msgs, 10*time.Second)
			d2, ok := pgoutbox.DeliveryOf(second)
			require.True(t, ok)
			require.Equal(t, 2, d2.Attempt)
			require.Equal(t, rowID, d2.RowID)
			require.True(t, d2.PublishedAt.Equal(published))
			require.True(t, d2.DueAt.After(published), "a retry is due after its nack, not at the publish")
			require.WithinDuration(t, nackedAt, d2.DueAt, 2*time.Second, "the retry is due when its delay (0) ends")
			require.Equal(t, key, d2.OrderingKey)
			// Keyed: ordered or not, the nacked row goes back to the table
			// (only its key waits for it) and is claimed again on the path.
			require.Equal(t, c.path, d2.Path)

			_ = pgoutbox.Reject(second, "checking the requeue")
			second.Nack()
			require.Eventually(t, func() bool {
				return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`) == 1
			}, 10*time.Second, 5*time.Millisecond)
			requeuedAt := time.Now()
			n, err := pgoutbox.RequeueDeadLettersMatching(ctx, tx.FromPgxPool(b.Pool), b.tables, pgoutbox.DeadLetterFilter{Topic: "facts"})
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			third := receive(t, msgs, 10*time.Second)
			d3, ok := pgoutbox.DeliveryOf(third)
			require.True(t, ok)
			require.Equal(t, 1, d3.Attempt, "a requeue starts the count again")
			require.Equal(t, rowID, d3.RowID)
			require.True(t, d3.PublishedAt.Equal(published), "a requeue keeps the publish time")
			require.WithinDuration(t, requeuedAt, d3.DueAt, 2*time.Second, "a requeued message is due at the requeue")
			require.Equal(t, "billing", d3.ConsumerGroup)
			require.Equal(t, c.path, d3.Path)
			third.Ack()
			require.Eventually(t, func() bool { return b.outboxRows(t, "facts") == 0 }, 10*time.Second, 5*time.Millisecond)
			require.NoError(t, sub.Close()) // the Observer has every event once Close returns

			var out []pgoutbox.Event
			for _, e := range eventsOfKind(ev.snapshot(), pgoutbox.EventHandedOut) {
				if e.RowID == rowID {
					out = append(out, e)
				}
			}
			require.Len(t, out, 3, "one handed_out per delivery")
			for i, want := range []pgoutbox.Delivery{d, d2, d3} {
				e := out[i]
				require.Equal(t, "facts", e.Topic)
				require.Equal(t, "billing", e.Group)
				require.Equal(t, want.RowID, e.RowID)
				require.Equal(t, want.Attempt, e.Deliveries)
				require.Equal(t, want.Path, e.Path)
				require.True(t, e.CreatedAt.Equal(published))
				require.True(t, e.DueAt.Equal(want.DueAt))
				require.GreaterOrEqual(t, e.Lateness, -time.Second, "lateness is measured against the database clock")
				require.Less(t, e.Lateness, 10*time.Second)
			}

			_, ok = pgoutbox.DeliveryOf(newMsg("not delivered"))
			require.False(t, ok, "a message no subscriber delivered has no delivery facts")
		})
	}
}

// A delayed message is due at its time, not at its publish.
func TestDeliveryFactsOfADelayedMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, nil)
	msgs, err := sub.Subscribe(context.Background(), "later")
	require.NoError(t, err)
	m := newMsg("x")
	pgoutbox.DeliverAfter(m, 300*time.Millisecond)
	b.publishInTx(t, "later", true, m)
	got := receive(t, msgs, 10*time.Second)
	d, ok := pgoutbox.DeliveryOf(got)
	require.True(t, ok)
	require.InDelta(t, 300*time.Millisecond, d.DueAt.Sub(d.PublishedAt), float64(5*time.Millisecond))
	got.Ack()
}

// PublishHook sees every message of a Publish call, with the call's
// context, before the row is written: what it adds to the metadata is
// delivered.
func TestPublishHookAddsMetadata(t *testing.T) {
	t.Parallel()
	b := setup(t)
	type key struct{}
	var mu sync.Mutex
	var seen []string
	hook := pgoutbox.PublishHookFunc(func(ctx context.Context, topic string, msg *message.Message) {
		mu.Lock()
		seen = append(seen, msg.UUID)
		mu.Unlock()
		msg.Metadata.Set("from-hook", topic+"/"+ctx.Value(key{}).(string))
	})
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, PublishHook: hook}, nil)
	require.NoError(t, err)
	m1, m2 := newMsg("1"), newMsg("2")
	m1.SetContext(context.WithValue(context.Background(), key{}, "call"))
	require.NoError(t, pub.Publish("hooked", m1, m2))
	require.Equal(t, []string{m1.UUID, m2.UUID}, seen)

	sub := b.subscriber(t, nil)
	msgs, err := sub.Subscribe(context.Background(), "hooked")
	require.NoError(t, err)
	for range 2 {
		got := receive(t, msgs, 10*time.Second)
		require.Equal(t, "hooked/call", got.Metadata.Get("from-hook"), "the hook's metadata, with the first message's context")
		got.Ack()
	}
}

// The library's warnings reach an slog handler as WARN records (a parked
// row, with no dead-letter table), where Watermill's slog adapter gives
// them at INFO, which a handler at LevelWarn drops.
func TestSlogLoggerLogsWarningsAtWarn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newRecordCapture(slog.LevelDebug)
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
		Tables:          schema.Config{Schema: b.Schema, Table: "outbox", NoDeadLetterTable: true},
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: time.Second,
	}, pgoutbox.NewSlogLogger(slog.New(h)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(context.Background(), "warned")
	require.NoError(t, err)
	b.publishInTx(t, "warned", true, newMsg("x"))
	m := receive(t, msgs, 10*time.Second)
	_ = pgoutbox.Reject(m, "bad")
	m.Nack()
	require.Eventually(t, func() bool { return len(h.find(slog.LevelWarn, "parked")) == 1 }, 10*time.Second, 5*time.Millisecond)
	rec := h.find(slog.LevelWarn, "parked")[0]
	require.Equal(t, "warned", rec.attrs["topic"], "the subscription's fields come along")
	require.NotContains(t, rec.attrs, "severity", "the level says it")
	require.Empty(t, h.find(slog.LevelInfo, "parked"), "the warning is not an INFO record too")
}

// recordCapture is an slog.Handler that keeps the records at or above its
// level.
type recordCapture struct {
	level slog.Level
	mu    *sync.Mutex
	recs  *[]capturedRecord
	with  []slog.Attr
}

type capturedRecord struct {
	level slog.Level
	msg   string
	attrs map[string]any
}

func newRecordCapture(level slog.Level) *recordCapture {
	return &recordCapture{level: level, mu: &sync.Mutex{}, recs: &[]capturedRecord{}}
}

func (h *recordCapture) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level }

func (h *recordCapture) Handle(_ context.Context, r slog.Record) error {
	rec := capturedRecord{level: r.Level, msg: r.Message, attrs: map[string]any{}}
	for _, a := range h.with {
		rec.attrs[a.Key] = a.Value.Any()
	}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.Any()
		return true
	})
	h.mu.Lock()
	*h.recs = append(*h.recs, rec)
	h.mu.Unlock()
	return nil
}

func (h *recordCapture) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *h
	c.with = append(append([]slog.Attr(nil), h.with...), attrs...)
	return &c
}

func (h *recordCapture) WithGroup(string) slog.Handler { return h }

// find returns the records at level whose message contains substr.
func (h *recordCapture) find(level slog.Level, substr string) []capturedRecord {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []capturedRecord
	for _, r := range *h.recs {
		if r.level == level && strings.Contains(strings.ToLower(r.msg), substr) {
			out = append(out, r)
		}
	}
	return out
}
