package pgoutboxotel

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// ScopeName is the instrumentation scope of the tracer and the meter.
const ScopeName = "github.com/pgoutbox/watermill-pgoutbox/pgoutboxotel"

// System is the messaging.system attribute of every span and measurement.
// The messaging conventions name brokers ("kafka", "rabbitmq"); pgoutbox is
// the messaging system here (PostgreSQL is its store, and spans of database
// clients already say "postgresql"), so it names itself.
const System = "pgoutbox"

// Attributes of pgoutbox's own, in the messaging.<system> namespace the
// conventions give systems for theirs (modelled on
// messaging.gcp_pubsub.message.delivery_attempt and ordering_key).
const (
	// DeliveryAttemptKey is Delivery.Attempt: 1 for the first delivery.
	DeliveryAttemptKey = attribute.Key("messaging.pgoutbox.message.delivery_attempt")
	// OrderingKeyKey is the message's ordering key, when it has one.
	OrderingKeyKey = attribute.Key("messaging.pgoutbox.message.ordering_key")
	// ClaimPathKey is how the message was claimed: "held" or "lease".
	ClaimPathKey = attribute.Key("messaging.pgoutbox.claim_path")
)

// TracingOptions configure NewTracing. The zero value is usable.
type TracingOptions struct {
	// TracerProvider makes the consumer spans. Defaults to the global one
	// (otel.GetTracerProvider), also when it is set after NewTracing.
	TracerProvider trace.TracerProvider
	// Propagator writes the trace context into a message's metadata and
	// reads it back. Defaults to W3C Trace Context and Baggage (metadata
	// keys "traceparent", "tracestate" and "baggage"), whatever the global
	// propagator is, so a consumer elsewhere that reads those keys
	// (propagation.MapCarrier over the metadata) continues the trace.
	Propagator propagation.TextMapPropagator
}

// Tracing carries a trace through the outbox. As a pgoutbox.PublishHook
// (PublisherConfig.PublishHook) it writes the trace context of the
// publishing code into each message's metadata; its Middleware runs each
// handler in a consumer span that continues that trace. The metadata stays
// with the message through retries, the dead-letter table and a requeue,
// and a relay to a broker: a consumer there that extracts it continues the
// same trace. One Tracing serves every publisher and router of a process.
type Tracing struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
}

var _ pgoutbox.PublishHook = (*Tracing)(nil)

// NewTracing returns a Tracing.
func NewTracing(opts TracingOptions) *Tracing {
	tp := opts.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	prop := opts.Propagator
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	return &Tracing{tracer: tp.Tracer(ScopeName), prop: prop}
}

// BeforePublish implements pgoutbox.PublishHook: it writes into msg's
// metadata the trace context of msg's own context when that carries a
// span, else that of ctx (the Publish call's: its first message's). So
// build the message with the context your code runs in, the one your
// transaction was begun with:
//
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	msg.SetContext(ctx)
//
// A context with no span writes nothing (baggage aside): the consumer's
// span then starts a trace of its own.
func (t *Tracing) BeforePublish(ctx context.Context, _ string, msg *message.Message) {
	t.inject(ctx, msg)
}

func (t *Tracing) inject(ctx context.Context, msg *message.Message) {
	if own := msg.Context(); trace.SpanContextFromContext(own).IsValid() {
		ctx = own
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{} // a message built as a struct literal publishes without it
	}
	t.prop.Inject(ctx, propagation.MapCarrier(msg.Metadata))
}

// Middleware is a Router middleware that runs the handler in a consumer
// span ("process <topic>", kind consumer) whose parent is the trace
// context in the message's metadata: the span of the code that published
// it. A message without one (or with one that does not parse) gets a span
// of a new trace, and nothing fails. The span has the messaging
// conventions' attributes (messaging.system "pgoutbox",
// messaging.destination.name, messaging.operation.type and name
// "process", messaging.message.id, messaging.consumer.group.name for a
// named group, messaging.message.body.size) and, for a message a pgoutbox
// Subscriber delivered, DeliveryAttemptKey, OrderingKeyKey and
// ClaimPathKey. A handler error sets the span's status to Error.
//
// The handler's context carries the span, and the messages it returns
// carry it in their context and metadata: their publish (by the Router, or
// in the handler's transaction by tx.Middleware) continues the trace as the
// span's children. Add it first, so its span covers the other middlewares
// (Retry's attempts, tx.Middleware's commit):
//
//	router.AddMiddleware(tracing.Middleware, pgoutbox.ErrorRecorder, middleware.Retry{...}.Middleware)
func (t *Tracing) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		d, delivered := pgoutbox.DeliveryOf(msg)
		// A subscriber's message context carries the values of the
		// context Subscribe was given (pgoutbox's, GoChannel's), a span
		// among them when the Router was started under one: a message
		// without trace context of its own must not join it. Its parent is
		// what its metadata carries, or none.
		base := trace.ContextWithSpanContext(orig, trace.SpanContext{})
		parent := t.prop.Extract(base, propagation.MapCarrier(msg.Metadata))
		topic := message.SubscribeTopicFromCtx(orig)
		if topic == "" {
			topic = d.Topic
		}
		attrs := make([]attribute.KeyValue, 0, 10)
		attrs = append(attrs,
			semconv.MessagingSystemKey.String(System),
			semconv.MessagingDestinationName(topic),
			semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"),
			semconv.MessagingMessageID(msg.UUID),
			semconv.MessagingMessageBodySize(len(msg.Payload)),
		)
		if delivered {
			attrs = append(attrs, DeliveryAttemptKey.Int(d.Attempt), ClaimPathKey.String(d.Path))
			if d.ConsumerGroup != "" {
				attrs = append(attrs, semconv.MessagingConsumerGroupName(d.ConsumerGroup))
			}
			if d.OrderingKey != "" {
				attrs = append(attrs, OrderingKeyKey.String(d.OrderingKey))
			}
		}
		name := "process"
		if topic != "" {
			name += " " + topic
		}
		ctx, span := t.tracer.Start(parent, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
		defer span.End()
		msg.SetContext(ctx)
		// Back to its own context for the middlewares outside, as it came.
		defer msg.SetContext(orig)

		out, err := h(msg)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(errorType(err))
		}
		for _, o := range out {
			if o == nil {
				continue
			}
			t.inject(ctx, o) // the handler's span and baggage, unless o has a span of its own
			if !trace.SpanContextFromContext(o.Context()).IsValid() {
				o.SetContext(trace.ContextWithSpan(o.Context(), span))
			}
		}
		return out, err
	}
}

// errorType is a handler error's error.type: "rejected" for a rejection
// (Reject wraps ErrRejected in a type of the retry library it uses, which
// would be the name otherwise), the error's Go type for the others.
func errorType(err error) attribute.KeyValue {
	if errors.Is(err, pgoutbox.ErrRejected) {
		return semconv.ErrorTypeKey.String("rejected")
	}
	return semconv.ErrorType(err)
}
