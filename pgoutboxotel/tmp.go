package pgoutboxotel

import (
	_ "github.com/ThreeDotsLabs/watermill"
	_ "github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	_ "go.opentelemetry.io/otel"
	_ "go.opentelemetry.io/otel/metric"
	_ "go.opentelemetry.io/otel/sdk/metric"
	_ "go.opentelemetry.io/otel/sdk/trace"
	_ "go.opentelemetry.io/otel/sdk/trace/tracetest"
	_ "go.opentelemetry.io/otel/trace"
	_ "github.com/stretchr/testify/require"
)
