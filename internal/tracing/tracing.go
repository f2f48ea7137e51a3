// Package tracing owns whether and where a kfn process (a function's
// worker, kfn relay) exports OpenTelemetry traces. Tracing is off unless
// the standard OTEL_* environment variables ask for it; then spans go to an
// OTLP collector over HTTP (http/protobuf, the default) or gRPC, or to
// stdout (OTEL_TRACES_EXPORTER=console), through a batch span processor,
// which Shutdown flushes. Off, the tracer provider is OpenTelemetry's no-op
// one: spans cost a context value and carry their parent's span context, so
// a source record's W3C trace context still reaches the events it causes.
// What the spans are is the engine's and the relay's business; how trace
// context travels in headers is outbox's (outbox.Propagator).
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
)

// The OTEL_* variables that decide whether traces are exported, as
// settings declares them.
const (
	EnvSDKDisabled    = settings.OTelSDKDisabledEnv
	EnvTracesExporter = settings.OTelTracesExporterEnv
	EnvEndpoint       = settings.OTelEndpointEnv
	EnvTracesEndpoint = settings.OTelTracesEndpointEnv
	EnvProtocol       = settings.OTelProtocolEnv
	EnvTracesProtocol = settings.OTelTracesProtocolEnv
)

// The values of OTEL_TRACES_EXPORTER and OTEL_EXPORTER_OTLP_PROTOCOL kfn
// follows.
const (
	ExporterOTLP      = "otlp"
	ExporterConsole   = "console"
	ExporterNone      = "none"
	ProtocolHTTPProto = "http/protobuf"
	ProtocolGRPC      = "grpc"
)

// The collector's OTLP endpoint when no variable names one.
const (
	defaultOTLPHTTPURL = "http://localhost:4318"
	defaultOTLPGRPCURL = "http://localhost:4317"
)

// ShutdownTimeout bounds how long Shutdown waits for the last spans to
// reach the collector when the process stops.
const ShutdownTimeout = 5 * time.Second

// EnvError is an OTEL_* variable kfn cannot follow.
type EnvError struct {
	Var, Value, Msg string
}

func (e *EnvError) Error() string {
	return fmt.Sprintf("invalid %s=%q: %s", e.Var, e.Value, e.Msg)
}

// Provider is the tracer provider of a process: the no-op one, or an
// exporting one when the environment enables tracing.
type Provider struct {
	trace.TracerProvider
	sdk *sdktrace.TracerProvider // nil when tracing is off
}

// Off returns the no-op provider.
func Off() *Provider { return &Provider{TracerProvider: noop.NewTracerProvider()} }

// Enabled reports whether spans are exported.
func (p *Provider) Enabled() bool { return p.sdk != nil }

// Shutdown flushes the spans not yet exported and stops the exporter,
// waiting at most ShutdownTimeout. It is a no-op when tracing is off.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p.sdk == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
	defer cancel()
	if err := p.sdk.Shutdown(ctx); err != nil {
		return fmt.Errorf("flush traces at shutdown (within %s): %w", ShutdownTimeout, err)
	}
	return nil
}

// FromEnv returns the provider the OTEL_* variables ask for. Tracing is on
// when OTEL_TRACES_EXPORTER is "otlp" or "console", or when it is unset
// and OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is
// set; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off.
// OTLP goes over HTTP (http/protobuf) unless
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL says
// grpc; "console" writes the spans as JSON on stdout. service is the
// service.name unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES)
// names one. When tracing is on, FromEnv also makes the provider and
// outbox.Propagator OpenTelemetry's globals, so a handler's own spans
// (otel.Tracer(…).Start(ctx, …)) are exported with kfn's and nest under
// them. Export errors are logged on log at warn level.
func FromEnv(ctx context.Context, service string, log *slog.Logger) (*Provider, error) {
	exp, err := exporterFromEnv()
	if err != nil || exp == ExporterNone {
		return Off(), err
	}
	var (
		exporter sdktrace.SpanExporter
		endpoint string
		protocol string
	)
	if exp == ExporterConsole {
		exporter, err = stdouttrace.New()
		if err != nil {
			return nil, fmt.Errorf("OpenTelemetry console trace exporter: %w", err)
		}
	} else {
		if protocol, err = protocolFromEnv(); err != nil {
			return nil, err
		}
		if endpoint, err = checkEndpoint(protocol); err != nil {
			return nil, err
		}
		if protocol == ProtocolGRPC {
			exporter, err = otlptracegrpc.New(ctx)
		} else {
			exporter, err = otlptracehttp.New(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("OpenTelemetry OTLP trace exporter (%s): %w", protocol, err)
		}
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(service)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(), // last: OTEL_SERVICE_NAME wins
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, &EnvError{Var: settings.OTelResourceAttributes, Value: os.Getenv(settings.OTelResourceAttributes), Msg: err.Error()}
	}
	sdk := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	otel.SetTracerProvider(sdk)
	otel.SetTextMapPropagator(outbox.Propagator)
	// A collector out of reach fails every export: logged once per step
	// of repeatlog's schedule, with the count.
	exportFailures := repeatlog.New()
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		exportFailures.Failed(context.Background(), log, slog.LevelWarn, "OpenTelemetry: trace export failed", "err", err)
	}))
	if exp == ExporterConsole {
		log.Info("writing traces on stdout", "exporter", exp, "service", serviceName(res, service))
	} else {
		log.Info("exporting traces over OTLP", "protocol", protocol, "endpoint", redact.Redact(endpoint), "service", serviceName(res, service))
	}
	return &Provider{TracerProvider: sdk, sdk: sdk}, nil
}

// exporterFromEnv decides from the environment where traces go: "otlp",
// "console" or "none" (off).
func exporterFromEnv() (string, error) {
	if v := os.Getenv(EnvSDKDisabled); strings.EqualFold(strings.TrimSpace(v), "true") {
		return ExporterNone, nil
	}
	switch v := strings.TrimSpace(os.Getenv(EnvTracesExporter)); v {
	case ExporterNone, ExporterOTLP, ExporterConsole:
		return v, nil
	case "":
		if os.Getenv(EnvEndpoint) == "" && os.Getenv(EnvTracesEndpoint) == "" {
			return ExporterNone, nil
		}
		return ExporterOTLP, nil
	default:
		return "", &EnvError{Var: EnvTracesExporter, Value: v, Msg: `kfn exports traces with "otlp" or "console": set one of them or "none" (or unset it)`}
	}
}

// protocolFromEnv returns the OTLP protocol: the traces-specific
// variable's, else the general one's, else http/protobuf.
func protocolFromEnv() (string, error) {
	for _, name := range []string{EnvTracesProtocol, EnvProtocol} {
		switch v := strings.TrimSpace(os.Getenv(name)); v {
		case "":
			continue
		case ProtocolHTTPProto, ProtocolGRPC:
			return v, nil
		default:
			return "", &EnvError{Var: name, Value: v, Msg: `kfn sends OTLP over "http/protobuf" (the collector's port 4318) or "grpc" (port 4317): set one of them (or unset it)`}
		}
	}
	return ProtocolHTTPProto, nil
}

// checkEndpoint returns the OTLP endpoint traces go to, and an error when
// the variable that names it is not an http(s) URL (the exporter would
// ignore it and send to localhost). With grpc, http:// is a connection
// without TLS, as the exporter reads it.
func checkEndpoint(protocol string) (string, error) {
	example, def := "http://otel-collector:4318", defaultOTLPHTTPURL
	if protocol == ProtocolGRPC {
		example, def = "http://otel-collector:4317", defaultOTLPGRPCURL
	}
	for _, name := range []string{EnvTracesEndpoint, EnvEndpoint} {
		v := os.Getenv(name)
		if v == "" {
			continue
		}
		u, err := url.Parse(v)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return "", &EnvError{Var: name, Value: redact.Redact(v), Msg: fmt.Sprintf("want an http:// or https:// URL of the collector's OTLP receiver (%s), e.g. %s", protocol, example)}
		}
		return v, nil
	}
	return def, nil
}

func serviceName(res *resource.Resource, fallback string) string {
	if v, ok := res.Set().Value(semconv.ServiceNameKey); ok {
		return v.AsString()
	}
	return fallback
}
