// Middleware-stack runs a transactional handler behind the recommended
// Router middleware stack, in its one order: ErrorRecorder, PoisonQueue,
// Retry, Recoverer, tx.Middleware, CorrelationID. Three orders show what
// each layer does: one panics after its write, then confirms (Recoverer
// turns the panic into an error, Retry tries again in a new transaction,
// the first write rolled back); one fails every attempt and lands on the
// poison topic with its write undone; one is rejected and lands in the
// dead-letter table, its reason recorded by ErrorRecorder. The confirmed
// order's output message carries the incoming correlation id.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/middleware-stack
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
	topic          = "orders.placed"
	confirmedTopic = "orders.confirmed"
	poisonTopic    = "orders.poison"
)

func main() {
	if err := run(); err != nil {
		log.Fatalf("middleware-stack example failed: %v", err)
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
	tables := schema.Config{Schema: "pgoutbox_middleware_stack_example", Table: "outbox"}
	sch := pgx.Identifier{tables.Schema}.Sanitize()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sch+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+sch+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `CREATE TABLE `+sch+`.orders (id text PRIMARY KEY, status text NOT NULL);
		INSERT INTO `+sch+`.orders VALUES ('order-1', 'placed'), ('order-2', 'placed'), ('order-3', 'placed')`); err != nil {
		return err
	}

	logger := watermill.NopLogger{} // the handlers fail on purpose
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}

	// One publisher for everything: in the handler's transaction when the
	// message's context carries one (tx.Middleware puts it there), through
	// the pool otherwise (the poison copy, the orders published below).
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	txMiddleware, err := tx.Middleware(tx.FromPgxPool(pool), tx.MiddlewareConfig{Publisher: pub})
	if err != nil {
		return err
	}
	// Rejected messages go to the dead-letter table, everything else
	// that fails every attempt to the poison topic; but not a message the
	// subscriber delivers again anyway (its context ended by a drain past
	// DrainTimeout or by AckDeadline, its lease lost): it is no poison.
	poisonQueue, err := middleware.PoisonQueueWithFilter(pub, poisonTopic, func(err error) bool {
		return !errors.Is(err, pgoutbox.ErrRejected) && !pgoutbox.Redelivered(err)
	})
	if err != nil {
		return err
	}
	// The first added is the outermost.
	router.AddMiddleware(
		pgoutbox.ErrorRecorder, // records the error that comes out of the whole stack, for last_error and the RetryPolicy
		poisonQueue,            // outside Retry: only what failed every attempt is poisoned
		middleware.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond}.Middleware, // each attempt in a new transaction
		middleware.Recoverer,     // inside Retry, outside the transaction: a panic rolls back, then is retried as an error
		txMiddleware,             // the handler's writes, its output messages and the message's completion: one transaction
		middleware.CorrelationID, // inside tx.Middleware: the outputs it publishes carry the correlation id
	)

	var mu sync.Mutex
	attempts := map[string]int{}
	router.AddHandler("confirm_order", topic, sub, confirmedTopic, pub, func(msg *message.Message) ([]*message.Message, error) {
		id := string(msg.Payload)
		mu.Lock()
		attempts[id]++
		n := attempts[id]
		mu.Unlock()
		if id == "order-3" {
			return nil, pgoutbox.Reject(msg, "order-3 is not a valid order")
		}
		pgTx, _ := tx.PgxTxFromContext(msg.Context())
		if _, err := pgTx.Exec(msg.Context(), `UPDATE `+sch+`.orders SET status = 'confirmed' WHERE id = $1`, id); err != nil {
			return nil, err
		}
		switch {
		case id == "order-2":
			return nil, errors.New("inventory unavailable") // after the write: it rolls back
		case n == 1:
			panic("inventory client not ready") // after the write: it rolls back
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(id))}, nil
	})
	confirmed := make(chan *message.Message, 1)
	router.AddConsumerHandler("notify_customer", confirmedTopic, sub, func(msg *message.Message) error {
		confirmed <- msg
		return nil
	})
	poisoned := make(chan *message.Message, 1)
	router.AddConsumerHandler("alert_on_poison", poisonTopic, sub, func(msg *message.Message) error {
		poisoned <- msg
		return nil
	})

	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()
	<-router.Running()
	for _, id := range []string{"order-1", "order-2", "order-3"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(id))
		middleware.SetCorrelationID("corr-"+id, msg)
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}

	timeout := time.After(15 * time.Second)
	var conf, poison *message.Message
	for conf == nil || poison == nil {
		select {
		case conf = <-confirmed:
			fmt.Printf("notify_customer: %s confirmed (correlation id %s)\n", conf.Payload, middleware.MessageCorrelationID(conf))
		case poison = <-poisoned:
			fmt.Printf("alert_on_poison: %s poisoned: %s\n", poison.Payload, poison.Metadata.Get(middleware.ReasonForPoisonedKey))
		case err := <-routerErr:
			return fmt.Errorf("router stopped: %v", err)
		case <-timeout:
			return errors.New("timed out waiting for the confirmed and the poisoned order")
		}
	}
	exec := tx.FromPgxPool(pool)
	var letters pgoutbox.DeadLetterPage
	for len(letters.Letters) == 0 {
		if letters, err = pgoutbox.DeadLetters(ctx, exec, tables, pgoutbox.DeadLetterFilter{Topic: topic}); err != nil {
			return err
		}
		select {
		case <-timeout:
			return errors.New("timed out waiting for the rejected order's dead letter")
		case <-time.After(10 * time.Millisecond):
		}
	}
	dl := letters.Letters[0]
	fmt.Printf("dead letter: %s %s: %s\n", dl.Payload, dl.FailureReason, dl.LastError)
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}

	statuses := map[string]string{}
	rows, err := pool.Query(ctx, `SELECT id, status FROM `+sch+`.orders`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id, status string
		if err := rows.Scan(&id, &status); err != nil {
			return err
		}
		statuses[id] = status
	}
	if err := rows.Err(); err != nil {
		return err
	}
	fmt.Printf("orders: order-1 %s, order-2 %s, order-3 %s\n", statuses["order-1"], statuses["order-2"], statuses["order-3"])

	mu.Lock()
	defer mu.Unlock()
	switch {
	case string(conf.Payload) != "order-1" || middleware.MessageCorrelationID(conf) != "corr-order-1":
		return fmt.Errorf("confirmed %s with correlation id %q, want order-1 with corr-order-1", conf.Payload, middleware.MessageCorrelationID(conf))
	case attempts["order-1"] != 2:
		return fmt.Errorf("order-1 took %d attempts, want 2 (a panic, then a commit)", attempts["order-1"])
	case string(poison.Payload) != "order-2" || attempts["order-2"] != 3:
		return fmt.Errorf("poisoned %s after %d attempts, want order-2 after 3", poison.Payload, attempts["order-2"])
	case len(letters.Letters) != 1 || string(dl.Payload) != "order-3" || dl.FailureReason != "rejected" || dl.LastError == "":
		return fmt.Errorf("dead letters %+v, want order-3 rejected with its error", letters.Letters)
	case statuses["order-1"] != "confirmed" || statuses["order-2"] != "placed" || statuses["order-3"] != "placed":
		return fmt.Errorf("statuses %v: want order-1 confirmed, the failed writes rolled back", statuses)
	}
	return nil
}
