package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay/relaytest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const brokerAddr = "127.0.0.1:4222"

// requireBroker skips where NATS is not reachable, unless
// PGOUTBOX_REQUIRE_BROKERS is set (CI sets it: there, a missing broker
// is a failure, not a skip).
func requireBroker(t *testing.T) {
	t.Helper()
	c, err := net.DialTimeout("tcp", brokerAddr, 2*time.Second)
	if err == nil {
		c.Close()
		return
	}
	msg := fmt.Sprintf("NATS is not reachable at %s (%v): start nats-server with JetStream (-js) to run the relay tests", brokerAddr, err)
	if os.Getenv("PGOUTBOX_REQUIRE_BROKERS") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// natsStream connects to NATS with opts and subscribes to a stream of its
// own (named prefix + a short UUID, deleted at the end of the test).
func natsStream(t *testing.T, prefix string, opts ...nats.Option) (*nats.Conn, string, <-chan *message.Message) {
	t.Helper()
	url := "nats://" + brokerAddr
	stream := prefix + watermill.NewShortUUID()
	conn, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteStream(conn, stream); conn.Close() })
	consumer, err := wmnats.NewSubscriber(subscriberConfig(url), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { consumer.Close() })
	received, err := consumer.Subscribe(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	return conn, stream, received
}

// The example runs against POSTGRES_DSN and NATS, and fails unless
// JetStream delivered every order and the outbox ended empty.
func TestExample(t *testing.T) {
	requireBroker(t)
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

// 10,000 messages relayed to JetStream while the relay's NATS connection
// is dropped twice (the client closes it and reconnects) and the relay
// process is replaced once: every message reaches JetStream at least
// once, the outbox ends empty, and no outbox row is acked before
// JetStream acknowledged its message (relaytest.Run checks all three).
func TestRelaySurvivesDroppedBrokerConnections(t *testing.T) {
	requireBroker(t)
	conn, stream, received := natsStream(t, "pgoutbox-test-relay-", nats.ReconnectWait(50*time.Millisecond), nats.MaxReconnects(-1))
	target, err := wmnats.NewPublisherWithNatsConn(conn, publisherConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	dropConnection := func() {
		if err := conn.ForceReconnect(); err != nil {
			t.Fatal(err)
		}
	}
	relaytest.Run(t, relaytest.Config{
		Target:      target,
		Received:    received,
		TargetTopic: stream,
		Faults: []relaytest.Fault{
			{Name: "drop the NATS connection", Do: dropConnection},
			{Name: "replace the relay process", ReplaceRelay: true},
			{Name: "drop the NATS connection", Do: dropConnection},
		},
	})
	if got := conn.Stats().Reconnects; got < 2 {
		t.Fatalf("the connection reconnected %d times, want at least 2", got)
	}
}

// A message larger than NATS takes (its payload and headers over the
// server's max_payload) is refused by the client for good. With
// relay.Config.Refused matching nats.ErrMaxPayload, the relay moves it to
// the dead-letter table after one try and relays the messages around it.
// (Without Refused it is retried without end: 12 tries in a minute.)
func TestRelayDeadLettersAMessageNATSRefuses(t *testing.T) {
	requireBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, env("POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tables := schema.Config{Schema: "pgoutbox_relay_nats_refused_" + watermill.NewShortUUID(), Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`)
	})
	conn, stream, received := natsStream(t, "pgoutbox-test-refused-")
	target, err := wmnats.NewPublisherWithNatsConn(conn, publisherConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}

	small := func() *message.Message {
		return message.NewMessage(watermill.NewUUID(), []byte(`{"event":"OrderPlaced"}`))
	}
	huge := message.NewMessage(watermill.NewUUID(), make([]byte, conn.MaxPayload()))
	msgs := []*message.Message{small(), huge, small()}
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables, MaxPayloadBytes: pgoutbox.NoPayloadLimit}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("orders", msgs...); err != nil {
		t.Fatal(err)
	}

	r, err := relay.New(pool, target, relay.Config{
		Topics:      []string{"orders"},
		TargetTopic: func(string) string { return stream },
		Subscriber:  pgoutbox.SubscriberConfig{Tables: tables},
		Refused:     func(err error) bool { return errors.Is(err, nats.ErrMaxPayload) },
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
		if err := <-done; err != nil {
			t.Error(err)
		}
	})

	want := map[string]bool{msgs[0].UUID: true, msgs[2].UUID: true}
	for len(want) > 0 {
		select {
		case m := <-received:
			if m.UUID == huge.UUID {
				t.Fatal("JetStream delivered the message NATS refuses")
			}
			delete(want, m.UUID)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("JetStream did not deliver %d of the other messages", len(want))
		}
	}
	dlq := pgx.Identifier{tables.Schema, tables.Table + schema.DefaultDeadLetterSuffix}.Sanitize()
	for {
		var reason, lastErr string
		err := pool.QueryRow(ctx, `SELECT failure_reason, last_error FROM `+dlq+` WHERE uuid = $1`, huge.UUID).Scan(&reason, &lastErr)
		if err == nil {
			if reason != pgoutbox.ReasonRejected {
				t.Fatalf("dead letter reason %q, want %q (last error %q)", reason, pgoutbox.ReasonRejected, lastErr)
			}
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			t.Fatalf("the refused message is not a dead letter (relay stats %+v)", r.Stats())
		}
	}
	if got := r.Stats().Refused; got != 1 {
		t.Fatalf("Stats().Refused = %d, want 1", got)
	}
}
