// Router-with-middlewares runs a pgoutbox Subscriber behind Watermill's
// standard middleware stack: CorrelationID, PoisonQueue, Retry and
// Recoverer. One message panics, then fails, then succeeds: Recoverer turns
// the panic into an error and Retry tries again in memory. Another always
// fails: once Retry gives up, PoisonQueue publishes it to a poison topic
// (through a pgoutbox publisher, so it is stored in the outbox too) and
// acks the original; a second handler consumes the poison topic.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/router-with-middlewares
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const (
	topic       = "payments.requested"
	poisonTopic = "payments.poison"
	retries     = 2 // attempts per delivery: 1 + retries
)

func main() {
	if err := run(); err != nil {
		log.Fatalf("router-with-middlewares example failed: %v", err)
	}
}

func run() error {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutbox_middlewares_example", Table: "outbox"}
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`) //nolint:errcheck

	// The handlers fail on purpose; the example prints what matters itself.
	logger := watermill.NopLogger{}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	// A context publisher writes in the transaction the message's context
	// carries (tx.Middleware puts one there) and through the pool
	// otherwise, as here: either way the poisoned copy lands in the outbox.
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	// Filtered, as the README's stack is: a message the subscriber
	// delivers again anyway (its context ended at AckDeadline or at a
	// shutdown past DrainTimeout) is not poisoned too, or it would be
	// handled twice; a Reject goes to the dead-letter table.
	poisonQueue, err := middleware.PoisonQueueWithFilter(pub, poisonTopic, func(err error) bool {
		return !errors.Is(err, pgoutbox.ErrRejected) && !pgoutbox.Redelivered(err)
	})
	if err != nil {
		return err
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}
	// The first added is the outermost. CorrelationID copies the incoming
	// correlation id onto the messages a handler returns (PoisonQueue
	// republishes the message itself, metadata and all). PoisonQueue sits
	// outside Retry, so only a message whose every attempt failed is
	// poisoned; Recoverer is innermost, so Retry sees a panic as an
	// ordinary error.
	router.AddMiddleware(
		middleware.CorrelationID,
		poisonQueue,
		middleware.Retry{MaxRetries: retries, InitialInterval: 10 * time.Millisecond}.Middleware,
		middleware.Recoverer,
	)

	var mu sync.Mutex
	attempts := map[string]int{} // by payment id
	paid := make(chan string, 1)
	router.AddConsumerHandler("charge_card", topic, sub, func(msg *message.Message) error {
		id := string(msg.Payload)
		mu.Lock()
		attempts[id]++
		n := attempts[id]
		mu.Unlock()
		switch {
		case id == "payment-2":
			fmt.Printf("charge_card: %s attempt %d: card declined\n", id, n)
			return errors.New("card declined")
		case n == 1:
			fmt.Printf("charge_card: %s attempt %d: panics\n", id, n)
			panic("payment gateway client not ready")
		case n == 2:
			fmt.Printf("charge_card: %s attempt %d: gateway timeout\n", id, n)
			return errors.New("gateway timeout")
		}
		fmt.Printf("charge_card: %s attempt %d: charged\n", id, n)
		paid <- id
		return nil
	})
	poisoned := make(chan *message.Message, 1)
	router.AddConsumerHandler("alert_on_poison", poisonTopic, sub, func(msg *message.Message) error {
		fmt.Printf("alert_on_poison: %s from %s, handler %s: %s (correlation id %s)\n",
			msg.Payload, msg.Metadata.Get(middleware.PoisonedTopicKey), msg.Metadata.Get(middleware.PoisonedHandlerKey),
			msg.Metadata.Get(middleware.ReasonForPoisonedKey), middleware.MessageCorrelationID(msg))
		poisoned <- msg
		return nil
	})

	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()
	<-router.Running()

	correlationIDs := map[string]string{}
	for _, id := range []string{"payment-1", "payment-2"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(id))
		correlationIDs[id] = watermill.NewShortUUID()
		middleware.SetCorrelationID(correlationIDs[id], msg)
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}

	timeout := time.After(10 * time.Second)
	var paidID string
	var poison *message.Message
	for paidID == "" || poison == nil {
		select {
		case paidID = <-paid:
		case poison = <-poisoned:
		case err := <-routerErr:
			return fmt.Errorf("router stopped: %v", err)
		case <-timeout:
			return fmt.Errorf("timed out: paid %q, poisoned %v", paidID, poison != nil)
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}

	// Check both outcomes.
	mu.Lock()
	defer mu.Unlock()
	if paidID != "payment-1" || attempts["payment-1"] != 3 {
		return fmt.Errorf("paid %q after %d attempts, want payment-1 after 3", paidID, attempts["payment-1"])
	}
	if got := string(poison.Payload); got != "payment-2" || attempts[got] != 1+retries {
		return fmt.Errorf("poisoned %q after %d attempts, want payment-2 after %d", got, attempts[got], 1+retries)
	}
	if got := middleware.MessageCorrelationID(poison); got != correlationIDs["payment-2"] {
		return fmt.Errorf("poisoned message has correlation id %q, want %q", got, correlationIDs["payment-2"])
	}
	if reason := poison.Metadata.Get(middleware.ReasonForPoisonedKey); reason != "card declined" {
		return fmt.Errorf("poison reason %q, want %q", reason, "card declined")
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize()).Scan(&left); err != nil {
		return err
	}
	if left != 0 {
		return fmt.Errorf("%d message(s) left in the outbox, want 0", left)
	}
	fmt.Println("payment-1 succeeded on its third attempt; payment-2 went to the poison topic; the outbox is empty")
	return nil
}
