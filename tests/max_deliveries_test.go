package tests

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// TestARowDeliveredBeforeIsNotLeasedWhileMessagesAreOut: with
// MaxDeliveries, a row delivered before runs alone. A claim that ran while
// a message was out leased such a row (counting its delivery) and gave it
// back at once; a crash of the message out before that give-back was
// written counted the row once more, and a message that had crashed
// nothing could reach the limit. A claim made while messages are out now
// leases only rows never delivered, and passes over the other, which is
// leased once, after the message out was answered. A trigger logs every
// lease the outbox's rows take, on each layout and claim mode, for a ready
// row delivered before, an expired lease, and keyed rows (the claim with a
// window).
func TestARowDeliveredBeforeIsNotLeasedWhileMessagesAreOut(t *testing.T) {
	t.Parallel()
	onEachLayout(t, func(t *testing.T, b *bundle) {
		_, err := b.Pool.Exec(context.Background(), `
CREATE TABLE `+b.Schema+`.lease_log (topic text, uuid text, deliveries int);
CREATE FUNCTION `+b.Schema+`.log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO `+b.Schema+`.lease_log VALUES (NEW.topic, NEW.uuid::text, NEW.deliveries);
    RETURN NULL;
END $$;
CREATE TRIGGER log_lease AFTER UPDATE ON `+b.Schema+`.outbox FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND OLD.lease_token IS DISTINCT FROM NEW.lease_token)
  EXECUTE FUNCTION `+b.Schema+`.log_lease()`)
		require.NoError(t, err)
		for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
			for _, variant := range []string{"ready", "expired", "keyed"} {
				t.Run(mode.String()+"/"+variant, func(t *testing.T) {
					t.Parallel()
					topic := "t-" + mode.String() + "-" + variant
					leases := func(uuid string) []int {
						return column[int](t, b, `SELECT deliveries FROM `+b.Schema+`.lease_log WHERE topic = $1 AND uuid = $2`, topic, uuid)
					}
					again := newMsg("again")
					pgoutbox.DeliverAfter(again, time.Hour) // into the outbox on either layout, made due below
					fresh := newMsg("fresh")
					if variant == "keyed" {
						pgoutbox.WithOrderingKey(again, "a")
						pgoutbox.WithOrderingKey(fresh, "f")
					}
					require.NoError(t, b.poolPublisher(t).Publish(topic, again, fresh))

					logs := &logCapture{}
					sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
						Tables: b.tables, ClaimMode: mode, MaxInFlight: 4, MaxDeliveries: 3,
						MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 100 * time.Millisecond,
					}, logs)
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					release := make(chan struct{})
					released := false
					defer func() {
						if !released {
							close(release)
						}
					}()
					started := make(chan struct{}, 1)
					handled := make(chan string, 4)
					runRouter(t, sub, topic, func(m *message.Message) error {
						if string(m.Payload) == "fresh" {
							started <- struct{}{}
							<-release
						}
						handled <- m.UUID
						return nil
					})
					select {
					case <-started:
					case <-time.After(30 * time.Second):
						t.Fatal("the fresh message never reached its handler")
					}
					// Delivered once before, as after a crash beside it or a
					// nack, and due now, while the fresh message is out.
					set := `deliveries = 1, available_at = now()`
					if variant == "expired" { // its holder gone, unknown to the liveness locks
						set += `, lease_token = gen_random_uuid(), leased_until = now() - interval '1 second', leased_by = 'gone'`
					}
					tx, err := b.Pool.Begin(context.Background())
					require.NoError(t, err)
					_, err = tx.Exec(context.Background(), `SET LOCAL session_replication_role = replica`) // not logged
					require.NoError(t, err)
					_, err = tx.Exec(context.Background(), `UPDATE `+b.Schema+`.outbox SET `+set+` WHERE uuid = $1`, again.UUID)
					require.NoError(t, err)
					require.NoError(t, tx.Commit(context.Background()))
					pollUntil(t, "a claim passing over the row delivered before, or leasing it", 30*time.Second, nil, func() bool {
						return len(leases(again.UUID)) > 0 || len(logs.find("debug", func(e logEntry) bool {
							return e.msg == "A message delivered before waits to run alone until the messages out are answered"
						})) > 0
					})
					require.Empty(t, leases(again.UUID), "a row delivered before was leased, its delivery counted, while a message was out")

					close(release)
					released = true
					got := map[string]bool{}
					for range 2 {
						select {
						case u := <-handled:
							got[u] = true
						case <-time.After(30 * time.Second):
							t.Fatalf("handled only %v", got)
						}
					}
					require.True(t, got[again.UUID] && got[fresh.UUID])
					require.Equal(t, []int{2}, leases(again.UUID), "leased once, its second delivery, once nothing else was out")
				})
			}
		}
	})
}

// A keyed row delivered before (R, key k), which a claim asked for by its
// key (k's previous message just ended) passed over while another message
// (S) was out, is asked for by its key again once S is answered. The ask
// was spent on the claim that passed over it: R was then found only by
// the scan's windows through a backlog held back by another key (here
// behind a scheduled row), a window per claim, dozens of claims later.
func TestAKeyedRowPassedOverIsAskedForByItsKeyAgain(t *testing.T) {
	t.Parallel()
	onEachLayout(t, func(t *testing.T, b *bundle) {
		ctx := context.Background()
		pub := b.poolPublisher(t)
		k1, slow := newMsg("K1"), newMsg("S")
		pgoutbox.WithOrderingKey(k1, "k")
		require.NoError(t, pub.Publish("t", k1, slow))
		_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key, available_at)
			VALUES ('t', gen_random_uuid()::text, 'H0', 'h', now() + interval '1 hour')`)
		require.NoError(t, err)
		_, err = b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, 'h', 'h' FROM generate_series(1, 20000)`)
		require.NoError(t, err)
		r := newMsg("R")
		pgoutbox.WithOrderingKey(r, "k")
		require.NoError(t, pub.Publish("t", r))
		_, err = b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox SET deliveries = 1 WHERE uuid = $1`, r.UUID) // delivered once before
		require.NoError(t, err)
		_, err = b.Pool.Exec(ctx, `ANALYZE `+b.Schema+`.outbox`)
		require.NoError(t, err)

		var claims atomic.Int64
		logs := &logCapture{}
		sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
			Tables: b.tables, ClaimMode: pgoutbox.ClaimLease, MaxInFlight: 4, MaxDeliveries: 3,
			MinPollInterval: 50 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
			Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
				if e.Kind == pgoutbox.EventClaimed {
					claims.Add(1)
				}
			}),
		}, logs)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		msgs, err := sub.Subscribe(t.Context(), "t")
		require.NoError(t, err)

		var s *message.Message
		k1Acked := false
		for s == nil || !k1Acked { // in either order
			m := receive(t, msgs, 30*time.Second)
			switch string(m.Payload) {
			case "K1":
				m.Ack() // k ends while S is out: the next claim asks for k
				k1Acked = true
			case "S":
				s = m
			default:
				t.Fatalf("%s before S was answered", m.Payload)
			}
		}
		pollUntil(t, "a claim passing over R while S is out", 30*time.Second, nil, func() bool {
			return len(logs.find("debug", func(e logEntry) bool {
				return e.msg == "A message delivered before waits to run alone until the messages out are answered"
			})) > 0
		})
		before := claims.Load()
		s.Ack()
		m := receive(t, msgs, time.Minute)
		require.Equal(t, "R", string(m.Payload))
		m.Ack()
		require.LessOrEqual(t, claims.Load()-before, int64(3), "R, its key's next row, waited for the scan's windows through the backlog")
	})
}
