// Package relaytest checks a relay.Relay against a real broker: it fills
// an outbox, relays it to the broker while faults are injected, consumes
// the broker's side, and fails the test unless every message arrived at
// least once, the outbox ended empty, and no outbox row was acked before
// the broker confirmed its message. The relay examples run it against
// RabbitMQ and NATS JetStream; run it against your own target the same way.
package relaytest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Config describes one run.
type Config struct {
	// Target is the broker publisher the relay publishes to. Required.
	Target message.Publisher
	// Received is the broker's side: every message published to
	// TargetTopic, from a subscriber that does not go through the faults.
	// The run acks each message. Required.
	Received <-chan *message.Message
	// TargetTopic is the broker topic (queue, stream, ...). Required.
	TargetTopic string
	// Messages is the number of messages relayed. Defaults to 10,000.
	Messages int
	// Faults are injected in order, each once the broker received its
	// share of the messages (the i-th of k faults after i/(k+1) of them).
	Faults []Fault
	// Relay adjusts the relay's config (Workers, BatchSize, ...); Topics,
	// TargetTopic and Subscriber.Tables are set by the run.
	Relay func(*relay.Config)
	// Timeout bounds the run. Defaults to 3 minutes.
	Timeout time.Duration
}

// Fault is one injected failure.
type Fault struct {
	Name string
	// Do injects it: drop the broker connection, restart the broker, ...
	Do func()
	// ReplaceRelay closes the running relay and starts a new one after
	// Do (as a redeployed relay process would).
	ReplaceRelay bool
}

// Result is what a run saw.
type Result struct {
	Messages       int
	Deliveries     int // broker deliveries, duplicates included
	FailedPublish  int64
	RelaysStarted  int
	RelayDuration  time.Duration
	FaultsInjected int
}

// Run relays cfg.Messages messages from a fresh outbox (a schema of its
// own, dropped at the end) to the broker and checks the guarantees.
func Run(t *testing.T, cfg Config) Result {
	t.Helper()
	if cfg.Messages == 0 {
		cfg.Messages = 10_000
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 3 * time.Minute
	}
	n := cfg.Messages
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	pool, tables := Outbox(t, ctx)
	uuids := Publish(t, ctx, pool, tables, "orders", n)
	uuidByRow := rowUUIDs(t, ctx, pool, tables)

	conf := &confirmations{confirmed: map[string]bool{}}
	target := &recordingPublisher{Publisher: cfg.Target, conf: conf}
	res := Result{Messages: n}
	var failed int64
	startRelay := func() (*relay.Relay, chan error) {
		rc := relay.Config{
			Topics:      []string{"orders"},
			TargetTopic: func(string) string { return cfg.TargetTopic },
			Workers:     4,
			Subscriber: pgoutbox.SubscriberConfig{
				MinPollInterval: 20 * time.Millisecond,
				MaxPollInterval: 200 * time.Millisecond,
				Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
					if e.Kind == pgoutbox.EventAcked {
						conf.acked(uuidByRow[e.RowID])
					}
				}),
			},
		}
		if cfg.Relay != nil {
			cfg.Relay(&rc)
		}
		rc.Subscriber.Tables = tables
		r, err := relay.New(pool, target, rc)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		res.RelaysStarted++
		return r, done
	}
	stopRelay := func(r *relay.Relay, done chan error) {
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		failed += r.Stats().Failed
	}
	start := time.Now()
	r, done := startRelay()

	seen := make(map[string]int, n)
	faults := cfg.Faults
	for len(seen) < n {
		select {
		case m := <-cfg.Received:
			seen[m.UUID]++
			res.Deliveries++
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("the broker delivered %d of %d messages", len(seen), n)
		}
		if len(faults) > 0 && len(seen) >= (res.FaultsInjected+1)*n/(len(cfg.Faults)+1) {
			t.Logf("after %d messages: %s", len(seen), faults[0].Name)
			if faults[0].Do != nil {
				faults[0].Do()
			}
			if faults[0].ReplaceRelay {
				stopRelay(r, done)
				r, done = startRelay()
			}
			faults = faults[1:]
			res.FaultsInjected++
		}
	}
	for _, u := range uuids {
		if seen[u] == 0 {
			t.Fatalf("message %s never reached the broker", u)
		}
	}
	waitOutboxEmpty(t, ctx, r)
	res.RelayDuration = time.Since(start)
	stopRelay(r, done)
	res.FailedPublish = failed

	conf.mu.Lock()
	defer conf.mu.Unlock()
	if len(conf.early) > 0 {
		t.Fatalf("%d outbox rows were acked before the broker confirmed their message, e.g. %s", len(conf.early), conf.early[0])
	}
	if conf.acks < n {
		t.Fatalf("%d acks observed, want at least %d", conf.acks, n)
	}
	t.Logf("%d messages in %v, %d broker deliveries (%d duplicates), %d faults, %d relays, %d failed publishes",
		n, res.RelayDuration.Round(time.Millisecond), res.Deliveries, res.Deliveries-n, res.FaultsInjected, res.RelaysStarted, res.FailedPublish)
	return res
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

// Close leaves the target to its owner.
func (p *recordingPublisher) Close() error { return nil }

// Outbox creates an outbox in a schema of its own (pgoutboxtest.NewSchema:
// the same PostgreSQL discovery as the project's tests), dropped when the
// test ends, and returns a pool on it (closed then too) and its tables.
func Outbox(t testing.TB, ctx context.Context) (*pgxpool.Pool, schema.Config) {
	t.Helper()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{MaxConns: 16})
	tables := schema.Config{Schema: s.Name, Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(s.Pool), tables); err != nil {
		t.Fatal(err)
	}
	return s.Pool, tables
}

// Publish writes n messages to topic in batches of 500 and returns their
// UUIDs.
func Publish(t testing.TB, ctx context.Context, pool *pgxpool.Pool, tables schema.Config, topic string, n int) []string {
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

func rowUUIDs(t testing.TB, ctx context.Context, pool *pgxpool.Pool, tables schema.Config) map[int64]string {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT id, uuid FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	byRow := map[int64]string{}
	for rows.Next() {
		var id int64
		var u string
		if err := rows.Scan(&id, &u); err != nil {
			t.Fatal(err)
		}
		byRow[id] = u
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return byRow
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
