package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// routerConsumer consumes through a Watermill message.Router with one
// consumer handler, as users of pgoutbox and watermill-sql do: the router's
// per-message goroutine and channel hops are part of what is measured.
type routerConsumer struct {
	*failure
	router  *message.Router
	sub     message.Subscriber
	runDone chan struct{}
	// waitAcked is the system's way to know that acks reached the database.
	waitAckedFn func(ctx context.Context, timeout time.Duration) error

	started   bool // start and close run on the scenario's goroutine
	closeOnce sync.Once
	closeErr  error
	closing   chan struct{}
}

func newRouterConsumer(b *bench, sub message.Subscriber, handle func(uuid string) error, mw ...message.HandlerMiddleware) (*routerConsumer, error) {
	router, err := message.NewRouter(message.RouterConfig{}, b.logger)
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(mw...)
	rc := &routerConsumer{
		failure: newFailure(),
		router:  router,
		sub:     sub,
		runDone: make(chan struct{}),
		closing: make(chan struct{}),
	}
	// A no-op handler apart from the scenario's hook (counting, timing).
	router.AddConsumerHandler("bench", topic, sub, func(msg *message.Message) error {
		if err := handle(msg.UUID); err != nil {
			rc.fail(err)
			return err
		}
		return nil
	})
	return rc, nil
}

func (rc *routerConsumer) start(ctx context.Context) error {
	rc.started = true
	go func() {
		defer close(rc.runDone)
		err := rc.router.Run(ctx)
		select {
		case <-rc.closing:
		default:
			// The router stopped on its own: the subscription ended.
			rc.fail(fmt.Errorf("router stopped before the run ended: %v", err))
		}
	}()
	select {
	case <-rc.router.Running():
		return nil
	case <-rc.runDone:
		return rc.err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (rc *routerConsumer) waitAcked(ctx context.Context, timeout time.Duration) error {
	return rc.waitAckedFn(ctx, timeout)
}

// close stops the router (which closes the subscriber), waits for Run to
// return, and closes the subscriber again (idempotent) in case the router
// never ran.
func (rc *routerConsumer) close() error {
	rc.closeOnce.Do(func() {
		close(rc.closing)
		err := rc.router.Close()
		if rc.started {
			select {
			case <-rc.runDone:
			case <-time.After(time.Minute):
				err = errors.Join(err, errors.New("router did not stop within a minute"))
			}
		}
		rc.closeErr = errors.Join(err, rc.sub.Close())
	})
	return rc.closeErr
}
