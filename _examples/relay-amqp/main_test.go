package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const brokerAddr = "127.0.0.1:5672"

// requireBroker skips where RabbitMQ is not reachable, unless
// PGOUTBOX_REQUIRE_BROKERS is set (CI sets it: there, a missing broker
// is a failure, not a skip).
func requireBroker(t *testing.T) {
	t.Helper()
	c, err := net.DialTimeout("tcp", brokerAddr, 2*time.Second)
	if err == nil {
		c.Close()
		return
	}
	msg := fmt.Sprintf("RabbitMQ is not reachable at %s (%v): start it (rabbitmq-server -detached) to run the relay tests", brokerAddr, err)
	if os.Getenv("PGOUTBOX_REQUIRE_BROKERS") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// The example runs against POSTGRES_DSN and RabbitMQ, and fails unless
// RabbitMQ delivered every order and the outbox ended empty.
func TestExample(t *testing.T) {
	requireBroker(t)
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

// 10,000 messages relayed to RabbitMQ while the relay's broker connection
// is dropped twice (by a proxy that closes it, as a network fault would)
// and the relay process is replaced once. Every message reaches RabbitMQ
// at least once, the outbox ends empty, and no outbox row is acked before
// RabbitMQ confirmed its message.
func TestRelaySurvivesDroppedBrokerConnections(t *testing.T) {
	requireBroker(t)
	const n = 10_000
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pool, tables := outbox(t, ctx)

	// RabbitMQ consumer, on a direct connection.
	queue := "pgoutbox-test.relay." + watermill.NewShortUUID()
	brokerSub, err := amqp.NewSubscriber(brokerConfig("amqp://guest:guest@"+brokerAddr+"/"), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { brokerSub.Close() })
	received, err := brokerSub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}

	// The outbox: n messages, and their row ids (the relay's Observer
	// reports acks by row).
	uuids := publishOutbox(t, ctx, pool, tables, "orders", n)
	uuidByRow := map[int64]string{}
	rows, err := pool.Query(ctx, `SELECT id, uuid FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var u string
		if err := rows.Scan(&id, &u); err != nil {
			t.Fatal(err)
		}
		uuidByRow[id] = u
	}
	if rows.Err() != nil || len(uuidByRow) != n {
		t.Fatalf("outbox rows: %d (%v)", len(uuidByRow), rows.Err())
	}

	// The relay publishes through a proxy that can drop its connection.
	proxy := startFaultProxy(t, brokerAddr)
	pubCfg := brokerConfig("amqp://guest:guest@" + proxy.addr + "/")
	pubCfg.Connection.Reconnect = &amqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 1.5, BackoffMaxInterval: time.Second}
	brokerPub, err := amqp.NewPublisher(pubCfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { brokerPub.Close() })
	conf := &confirmations{confirmed: map[string]bool{}}
	target := &recordingPublisher{Publisher: brokerPub, conf: conf}
	startRelay := func() (*relay.Relay, chan error) {
		r, err := relay.New(pool, target, relay.Config{
			Topics:      []string{"orders"},
			TargetTopic: func(string) string { return queue },
			Workers:     4,
			Subscriber: pgoutbox.SubscriberConfig{
				Tables:          tables,
				MinPollInterval: 20 * time.Millisecond,
				MaxPollInterval: 200 * time.Millisecond,
				Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
					if e.Kind == pgoutbox.EventAcked {
						conf.acked(uuidByRow[e.RowID])
					}
				}),
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		return r, done
	}
	r, done := startRelay()

	seen := map[string]int{}
	deliveries := 0
	faults := []struct {
		at   int
		name string
		do   func()
	}{
		{n / 4, "drop the broker connection", proxy.cut},
		{n / 2, "replace the relay process", func() {
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			r, done = startRelay()
		}},
		{3 * n / 4, "drop the broker connection", proxy.cut},
	}
	for len(seen) < n {
		select {
		case m := <-received:
			seen[m.UUID]++
			deliveries++
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("RabbitMQ delivered %d of %d messages", len(seen), n)
		}
		if len(faults) > 0 && len(seen) >= faults[0].at {
			t.Logf("after %d messages: %s", len(seen), faults[0].name)
			faults[0].do()
			faults = faults[1:]
		}
	}
	for _, u := range uuids {
		if seen[u] == 0 {
			t.Fatalf("message %s never reached RabbitMQ", u)
		}
	}
	waitOutboxEmpty(t, ctx, r)
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	conf.mu.Lock()
	defer conf.mu.Unlock()
	if len(conf.early) > 0 {
		t.Fatalf("%d outbox rows were acked before RabbitMQ confirmed them, e.g. %s", len(conf.early), conf.early[0])
	}
	if conf.acks < n {
		t.Fatalf("%d acks observed, want at least %d", conf.acks, n)
	}
	t.Logf("%d messages, %d deliveries (%d duplicates), %d connection drops, %d failed publishes in the last relay",
		n, deliveries, deliveries-n, proxy.cuts.Load(), r.Stats().Failed)
}

// confirmations records which UUIDs the broker confirmed (Publish
// returned nil) and flags an outbox ack of any other.
type confirmations struct {
	mu        sync.Mutex
	confirmed map[string]bool
	early     []string
	acks      int
}

func (c *confirmations) acked(uuid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.acks++
	if !c.confirmed[uuid] {
		c.early = append(c.early, uuid)
	}
}

type recordingPublisher struct {
	message.Publisher
	conf *confirmations
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.conf.mu.Lock()
	defer p.conf.mu.Unlock()
	for _, m := range msgs {
		p.conf.confirmed[m.UUID] = true
	}
	return nil
}

func outbox(t testing.TB, ctx context.Context) (*pgxpool.Pool, schema.Config) {
	t.Helper()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tables := schema.Config{Schema: "relay_amqp_test_" + watermill.NewShortUUID()[:8], Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`)
	})
	return pool, tables
}

func publishOutbox(t testing.TB, ctx context.Context, pool *pgxpool.Pool, tables schema.Config, topic string, n int) []string {
	t.Helper()
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		t.Fatal(err)
	}
	uuids := make([]string, 0, n)
	for len(uuids) < n {
		batch := make([]*message.Message, min(500, n-len(uuids)))
		for i := range batch {
			batch[i] = message.NewMessage(watermill.NewUUID(), []byte(`{"event":"OrderPlaced"}`))
			batch[i].Metadata.Set("seq", fmt.Sprint(len(uuids)+i))
			batch[i].SetContext(ctx)
		}
		if err := pub.Publish(topic, batch...); err != nil {
			t.Fatal(err)
		}
		for _, m := range batch {
			uuids = append(uuids, m.UUID)
		}
	}
	return uuids
}

func waitOutboxEmpty(t testing.TB, ctx context.Context, r *relay.Relay) {
	t.Helper()
	for {
		lag, err := r.Lag(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if lag[0].Ready+lag[0].Scheduled+lag[0].Parked == 0 {
			return
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			t.Fatalf("the outbox still holds %+v", lag[0])
		}
	}
}
