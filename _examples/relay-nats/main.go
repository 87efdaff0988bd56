// relay-nats relays outbox messages to NATS JetStream: a service writes
// orders and their OrderPlaced messages in one PostgreSQL transaction, and
// a relay.Relay publishes them to a JetStream stream, deleting each outbox
// row only after JetStream acknowledged its message (a synchronous
// JetStream publish). The message UUID becomes the JetStream message ID
// (TrackMsgId), so JetStream drops the duplicates a retried batch sends.
//
//	POSTGRES_DSN=postgres://... NATS_URL=nats://127.0.0.1:4222 go run .
//
// It is a module of its own (run it from this directory), so the library
// does not depend on watermill-nats.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func main() {
	if err := run(); err != nil {
		log.Fatalf("relay-nats example failed: %v", err)
	}
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, env("POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutbox_relay_nats_example", Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `CREATE TABLE `+pgx.Identifier{tables.Schema, "orders"}.Sanitize()+` (id text PRIMARY KEY)`); err != nil {
		return err
	}

	// The broker side: a JetStream stream per topic (a stream name has no
	// dots), created on first use.
	url := env("NATS_URL", nats.DefaultURL)
	stream := "pgoutbox-example-orders-" + watermill.NewShortUUID()
	// Reconnect for ever: by default nats.go gives up after 60 attempts,
	// and every publish of the relay would fail from then on.
	conn, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer conn.Close()
	defer deleteStream(conn, stream)
	logger := watermill.NopLogger{}
	brokerPub, err := wmnats.NewPublisherWithNatsConn(conn, publisherConfig(), logger)
	if err != nil {
		return err
	}
	brokerSub, err := wmnats.NewSubscriber(subscriberConfig(url), logger)
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer brokerSub.Close()
	received, err := brokerSub.Subscribe(ctx, stream)
	if err != nil {
		return err
	}

	// The service: each order and its message commit together.
	const orders = 5
	for i := range orders {
		if err := placeOrder(ctx, pool, tables, fmt.Sprintf("order-%d", i)); err != nil {
			return err
		}
	}

	r, err := relay.New(pool, brokerPub, relay.Config{
		Topics:      []string{"orders"},
		TargetTopic: func(string) string { return stream },
		Subscriber:  pgoutbox.SubscriberConfig{Tables: tables},
		Logger:      logger,
	})
	if err != nil {
		return err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(ctx) }()

	for got := 0; got < orders; got++ {
		select {
		case m := <-received:
			fmt.Printf("JetStream delivered %s uuid=%s order=%s\n", m.Payload, m.UUID, m.Metadata.Get("order_id"))
			m.Ack()
		case <-ctx.Done():
			return fmt.Errorf("JetStream delivered %d of %d orders", got, orders)
		}
	}
	for {
		lag, err := r.Lag(ctx)
		if err != nil {
			return err
		}
		if lag[0].Ready == 0 {
			break
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return errors.New("the outbox still holds relayed messages")
		}
	}
	fmt.Printf("relayed %d messages, the outbox is empty\n", r.Stats().Relayed)
	if err := r.Close(); err != nil {
		return err
	}
	return <-relayDone
}

// jetStreamConfig provisions a stream per topic and gives JetStream the
// message UUID as its message ID, so a batch sent twice is stored once.
func jetStreamConfig() wmnats.JetStreamConfig {
	return wmnats.JetStreamConfig{
		AutoProvision:    true,
		TrackMsgId:       true,
		SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
	}
}

// publisherConfig publishes synchronously: Publish returns after
// JetStream stored each message, which is what makes the relay's acks
// safe (AckAsync would not).
func publisherConfig() wmnats.PublisherPublishConfig {
	return wmnats.PublisherPublishConfig{
		Marshaler:         &wmnats.NATSMarshaler{},
		SubjectCalculator: wmnats.DefaultSubjectCalculator,
		JetStream:         jetStreamConfig(),
	}
}

func subscriberConfig(url string) wmnats.SubscriberConfig {
	return wmnats.SubscriberConfig{
		URL:            url,
		AckWaitTimeout: 30 * time.Second,
		CloseTimeout:   5 * time.Second,
		Unmarshaler:    &wmnats.NATSMarshaler{},
		JetStream:      jetStreamConfig(),
	}
}

func deleteStream(conn *nats.Conn, stream string) {
	if js, err := conn.JetStream(); err == nil {
		_ = js.DeleteStream(stream)
	}
}

func placeOrder(ctx context.Context, pool *pgxpool.Pool, tables schema.Config, id string) error {
	return pgx.BeginFunc(ctx, pool, func(t pgx.Tx) error {
		if _, err := t.Exec(ctx, `INSERT INTO `+pgx.Identifier{tables.Schema, "orders"}.Sanitize()+` VALUES ($1)`, id); err != nil {
			return err
		}
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(t), pgoutbox.PublisherConfig{Tables: tables}, nil)
		if err != nil {
			return err
		}
		m := message.NewMessage(watermill.NewUUID(), []byte(`{"event":"OrderPlaced"}`))
		m.Metadata.Set("order_id", id)
		return pub.Publish("orders", m)
	})
}
