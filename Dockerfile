# The collector with its dashboard embedded, built from this repository:
#   docker build -t rankwatch .
#   docker run -p 127.0.0.1:7070:7070 -v rankwatch-data:/data rankwatch
# Used by docker-compose.yml. The builder runs the release command a developer runs
# (`cargo xtask dist --collector`: the dashboard, then the release binary into target/dist), so
# the image holds exactly the binary of the release archive, which the tests test.

FROM rust:1.95.0-bookworm AS build
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends nodejs npm \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The dashboard (wasm32 target, the locked wasm-bindgen-cli, npm packages), then the binary.
RUN cargo xtask dist --collector \
 && cp target/dist/bin/rankwatch /usr/local/bin/rankwatch

FROM debian:bookworm-slim
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home /data --shell /usr/sbin/nologin rankwatch \
 && mkdir -p /data /run/rankwatch && chown rankwatch /data /run/rankwatch
COPY --from=build /usr/local/bin/rankwatch /usr/local/bin/rankwatch
USER rankwatch
VOLUME /data
EXPOSE 7070
ENV RANKWATCH_DATA_DIR=/data \
    RANKWATCH_LISTEN=0.0.0.0:7070
HEALTHCHECK --interval=10s --timeout=3s CMD curl -fsS http://127.0.0.1:7070/healthz || exit 1
ENTRYPOINT ["rankwatch"]
CMD ["serve"]
