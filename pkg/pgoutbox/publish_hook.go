package pgoutbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// PublishHook adds to messages before a Publisher writes them. BeforePublish
// runs in the Publish call, once per message, in order; ctx is the call's
// context (the first message's, which bounds the statement), topic the
// call's topic. It may change msg.Metadata; its changes are written, and
// stay on msg. It must be safe for concurrent use and must not block.
type PublishHook interface {
	BeforePublish(ctx context.Context, topic string, msg *message.Message)
}

// PublishHookFunc adapts a function to PublishHook.
type PublishHookFunc func(ctx context.Context, topic string, msg *message.Message)

// BeforePublish calls f(ctx, topic, msg).
func (f PublishHookFunc) BeforePublish(ctx context.Context, topic string, msg *message.Message) {
	f(ctx, topic, msg)
}
