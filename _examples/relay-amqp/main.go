// relay-amqp relays outbox messages to RabbitMQ: a service writes orders
// and their OrderPlaced messages in one PostgreSQL transaction, and a
// relay.Relay publishes them to a RabbitMQ queue with publisher confirms,
// deleting each outbox row only after RabbitMQ confirmed its message. A
// RabbitMQ consumer receives them with their UUIDs and metadata.
//
//	POSTGRES_DSN=postgres://... AMQP_URI=amqp://guest:guest@127.0.0.1:5672/ go run .
//
// It is a module of its own (run it from this directory), so the library
// does not depend on watermill-amqp.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
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

func main() {
	if err := run(); err != nil {
		log.Fatalf("relay-amqp example failed: %v", err)
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
	tables := schema.Config{Schema: "pgoutbox_relay_amqp_example", Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `CREATE TABLE `+pgx.Identifier{tables.Schema, "orders"}.Sanitize()+` (id text PRIMARY KEY)`); err != nil {
		return err
	}

	// The broker side: a queue per topic; the publisher waits for
	// RabbitMQ's confirmation of every message (ConfirmDelivery), which
	// is what makes the relay's acks safe.
	queue := "pgoutbox-example.orders." + watermill.NewShortUUID()
	amqpCfg := brokerConfig(env("AMQP_URI", "amqp://guest:guest@127.0.0.1:5672/"))
	logger := watermill.NopLogger{}
	brokerPub, err := amqp.NewPublisher(amqpCfg, logger)
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer brokerPub.Close()
	brokerSub, err := amqp.NewSubscriber(amqpCfg, logger)
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer brokerSub.Close()
	received, err := brokerSub.Subscribe(ctx, queue) // declares the queue before anything is relayed
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
		TargetTopic: func(string) string { return queue },
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
			fmt.Printf("RabbitMQ delivered %s uuid=%s order=%s\n", m.Payload, m.UUID, m.Metadata.Get("order_id"))
			m.Ack()
		case <-ctx.Done():
			return fmt.Errorf("RabbitMQ delivered %d of %d orders", got, orders)
		}
	}
	// The outbox rows go once RabbitMQ confirmed; the lag says so.
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

// brokerConfig is a durable queue per topic with publisher confirms; the
// example's queues expire a minute after their last use.
func brokerConfig(uri string) amqp.Config {
	cfg := amqp.NewDurableQueueConfig(uri)
	cfg.Publish.ConfirmDelivery = true
	// No channel pool: watermill-amqp v3.0.2's pooled channels are not
	// reopened after a reconnect (Close then panics on a nil channel). A
	// channel per Publish call costs one round trip per batch.
	cfg.Publish.ChannelPoolSize = 0
	cfg.Consume.Qos.PrefetchCount = 256
	cfg.Queue.Arguments = map[string]any{"x-expires": int32(60_000)}
	return cfg
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
